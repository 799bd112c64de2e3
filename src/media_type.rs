//! Media types as HTTP headers and attachments give them: the essence a comparison needs
//! (type and subtype in lower case, parameters dropped), spelled in one place.

/// A media type without its parameters, lower case (`Image/PNG; x=1` → `image/png`).
pub(crate) fn essence(media_type: &str) -> String {
    media_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_essence_drops_parameters_space_and_case() {
        assert_eq!(essence("Image/PNG; x=1"), "image/png");
        assert_eq!(
            essence(" application/json ;charset=utf-8"),
            "application/json"
        );
        assert_eq!(essence(""), "");
    }
}
