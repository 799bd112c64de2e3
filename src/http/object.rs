//! Request bodies' objects are read from JSON objects only. serde's derived structs (and
//! internally tagged enums) also take a JSON array as their fields in order, so without this
//! `"auth": []` would be a conversation without credentials and `[["file", "/x"]]` an
//! attachment, where the OpenAPI document (and any gateway reading it) says both are a 400.
//! Every body type is read through [`Object`] at the top, and each nested object field
//! names one of the `deserialize_with` functions here.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// A `T` read from a JSON object, never from an array.
pub(super) struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }
        deserializer
            .deserialize_map(ObjectVisitor(PhantomData))
            .map(Object)
    }
}

/// An optional object field: absent or `null` is `None`.
pub(super) fn optional<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Object<T>>::deserialize(deserializer)?.map(|o| o.0))
}

/// A list of objects.
pub(super) fn each<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Vec::<Object<T>>::deserialize(deserializer)?
        .into_iter()
        .map(|o| o.0)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        #[serde(default)]
        name: Option<String>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
    enum Tagged {
        File { path: String },
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        #[serde(default, deserialize_with = "optional")]
        inner: Option<Inner>,
        #[serde(default, deserialize_with = "each")]
        items: Vec<Tagged>,
    }

    fn read(json: &str) -> Result<Outer, serde_json::Error> {
        serde_json::from_str::<Object<Outer>>(json).map(|o| o.0)
    }

    #[test]
    fn objects_are_read_as_serde_reads_them() {
        let outer = read(r#"{"inner": {"name": "a"}, "items": [{"type": "file", "path": "/x"}]}"#)
            .expect("objects");
        assert_eq!(
            outer.inner,
            Some(Inner {
                name: Some("a".into())
            })
        );
        assert_eq!(outer.items, vec![Tagged::File { path: "/x".into() }]);
        let empty = read(r#"{"inner": null}"#).expect("null is none");
        assert_eq!(empty.inner, None);
        assert!(empty.items.is_empty());
    }

    #[test]
    fn an_array_where_an_object_belongs_is_refused_at_every_level() {
        for json in [
            "[]",
            r#"[null, []]"#,
            r#"{"inner": []}"#,
            r#"{"inner": ["a"]}"#,
            r#"{"items": [["file", "/x"]]}"#,
        ] {
            let e = read(json).expect_err(json);
            assert!(
                e.to_string().contains("expected a JSON object"),
                "{json}: {e}"
            );
        }
    }

    #[test]
    fn unknown_fields_are_still_refused_inside() {
        let e = read(r#"{"inner": {"nam": "a"}}"#).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `nam`"), "{e}");
    }
}
