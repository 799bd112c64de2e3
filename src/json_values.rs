//! How many JSON values a peer's message holds, counted without parsing it: what bounds the
//! memory the message takes once parsed into a `serde_json::Value` (32 bytes a value, a
//! map's entries more), which its size in bytes does not (`[0,0,…]` is two bytes a value,
//! so a 16 MiB frame of it would take over 256 MiB parsed). The readers of the runtimes' pipes and
//! of the SDK endpoint's clients ([`crate::rpc::ConnectionOptions::max_frame_values`]) and
//! the HTTP API's bodies refuse a message holding more than [`value_limit`] of their byte
//! limit, before parsing it.

/// Bytes of a message's size limit per value a message may hold.
pub const BYTES_PER_VALUE: usize = 32;

/// The fewest values a limit allows, however small its byte limit.
pub const MIN_VALUE_LIMIT: usize = 65_536;

/// The most values a message under `max_bytes` may hold: one per [`BYTES_PER_VALUE`] bytes
/// of the limit, at least [`MIN_VALUE_LIMIT`]. Parsed, such a message takes a few times
/// its byte limit at most, where a message with a value every two bytes takes 32 times.
pub fn value_limit(max_bytes: usize) -> usize {
    (max_bytes / BYTES_PER_VALUE).max(MIN_VALUE_LIMIT)
}

/// Whether `json` holds more than `limit` values. Counts every `[`, `{`, `,` and `:`
/// outside strings: every value but the outermost follows a `[`, `,` or `:`, and each key
/// of an object a `{` or `,`, so the count is at least the values and keys there are
/// besides the outermost. Stops at the limit. Not a validator: text that is not JSON is
/// counted the same way, and its parser says what is wrong with it.
pub fn holds_more_than(json: &[u8], limit: usize) -> bool {
    values_within(json, limit).is_none()
}

/// How many values `json` holds, counted as [`holds_more_than`] counts them; `None` once
/// past `limit` (the count stops there).
pub fn values_within(json: &[u8], limit: usize) -> Option<usize> {
    let mut count = 0usize;
    let mut at = 0;
    while let Some(&byte) = json.get(at) {
        match byte {
            b'"' => {
                // To the closing quote, past escaped characters (an escaped quote included).
                at += 1;
                loop {
                    let Some(found) = json
                        .get(at..)
                        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
                    else {
                        // An unclosed string: nothing more to count.
                        return Some(count);
                    };
                    at += found;
                    if json[at] == b'\\' {
                        at += 2;
                    } else {
                        break;
                    }
                }
            }
            b'[' | b'{' | b',' | b':' => {
                count += 1;
                if count > limit {
                    return None;
                }
            }
            _ => {}
        }
        at += 1;
    }
    Some(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(json: &str) -> usize {
        let count = (0..=json.len())
            .find(|&limit| !holds_more_than(json.as_bytes(), limit))
            .expect("at most one count per byte");
        assert_eq!(values_within(json.as_bytes(), json.len()), Some(count));
        count
    }

    #[test]
    fn every_value_and_key_is_counted_once() {
        assert_eq!(count("0"), 0);
        assert_eq!(count("[]"), 1);
        assert_eq!(count("[0,0,0]"), 3);
        assert_eq!(count(r#"{"a":1,"b":[true,null]}"#), 6);
        assert_eq!(count(r#"[[[[]]]]"#), 4);
    }

    #[test]
    fn what_is_inside_a_string_is_not_counted() {
        assert_eq!(count(r#"["a,b:c[d{e"]"#), 1);
        // An escaped quote does not end the string, an escaped backslash before a quote
        // does.
        assert_eq!(count(r#"["a\",[,[", 1]"#), 2);
        assert_eq!(count(r#"["a\\", 1]"#), 2);
        assert_eq!(count(r#"{"k\u0022,":[1]}"#), 3);
    }

    #[test]
    fn text_cut_off_in_a_string_or_an_escape_ends_the_count() {
        assert!(!holds_more_than(br#"[1,"abc"#, 2));
        assert!(!holds_more_than(br#"[1,"abc\"#, 2));
        assert!(holds_more_than(br#"[1,2,"abc\"#, 2));
    }

    #[test]
    fn the_limit_is_one_value_per_32_bytes_and_never_below_65536() {
        assert_eq!(value_limit(0), MIN_VALUE_LIMIT);
        assert_eq!(value_limit(1 << 20), MIN_VALUE_LIMIT);
        assert_eq!(value_limit(16 << 20), 524_288);
    }
}
