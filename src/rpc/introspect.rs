//! Reads the wire field names of a `Deserialize` struct, for checking our types against the
//! runtime's shipped JSON schemas.
//!
//! serde's derived `Deserialize` for a struct calls `deserialize_struct` with the list of its
//! field names (after renaming); this deserializer records that list and stops.

use serde::de::{self, Deserialize, Visitor};

#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("introspection stop")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Stop
    }
}

struct FieldCatcher<'a>(&'a mut Vec<&'static str>);

impl<'de> de::Deserializer<'de> for FieldCatcher<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Stop> {
        self.0.extend_from_slice(fields);
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

/// The wire names of the fields of struct `T` (empty for non-struct types).
pub fn field_names<T: for<'de> Deserialize<'de>>() -> Vec<&'static str> {
    let mut fields = Vec::new();
    let _ = T::deserialize(FieldCatcher(&mut fields));
    fields
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[allow(dead_code)]
    struct S {
        tool_call_id: String,
        #[serde(rename = "type")]
        kind: u8,
    }

    #[test]
    fn reads_renamed_field_names() {
        assert_eq!(super::field_names::<S>(), vec!["toolCallId", "type"]);
        assert!(super::field_names::<u8>().is_empty());
    }
}
