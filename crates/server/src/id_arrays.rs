//! A request body read with its arrays of token ids kept compact: `prompt` and `tokens`, when
//! they are arrays of integers, take 4 bytes an id instead of a JSON value's 80 (a 60 MB
//! array of ids would otherwise become 2.4 GB of values).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The fields whose arrays of token ids are kept compact.
const ID_FIELDS: [&str; 2] = ["prompt", "tokens"];

/// A JSON object whose [`ID_FIELDS`] holding arrays of ids (each at most `u32::MAX`) are in
/// `ids`, not in `map`.
#[derive(Debug, Default)]
pub struct CompactBody {
    /// The other fields.
    pub map: Map<String, Value>,
    /// The arrays of ids, by field name.
    pub ids: Vec<(String, Vec<u32>)>,
}

/// A field's value: compact ids, or any other JSON value.
enum Field {
    Ids(Vec<u32>),
    Other(Value),
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Field, D::Error> {
        d.deserialize_any(FieldVisitor)
    }
}

struct FieldVisitor;

/// An element of an id array: an id, or the value that ends the compact reading.
fn as_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|i| u32::try_from(i).ok())
}

impl<'de> Visitor<'de> for FieldVisitor {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field, A::Error> {
        let mut ids = Vec::new();
        while let Some(v) = seq.next_element::<Value>()? {
            if let Some(id) = as_id(&v) {
                ids.push(id);
                continue;
            }
            // Not an array of ids after all: the rest as values.
            let mut all: Vec<Value> = ids.into_iter().map(Value::from).collect();
            all.push(v);
            while let Some(v) = seq.next_element::<Value>()? {
                all.push(v);
            }
            return Ok(Field::Other(Value::Array(all)));
        }
        Ok(Field::Ids(ids))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Field, A::Error> {
        Value::deserialize(de::value::MapAccessDeserializer::new(map)).map(Field::Other)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Field, E> {
        Ok(Field::Other(v.into()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Other(Value::Null))
    }

    fn visit_none<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Other(Value::Null))
    }
}

impl<'de> Deserialize<'de> for CompactBody {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<CompactBody, D::Error> {
        d.deserialize_map(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = CompactBody;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<CompactBody, A::Error> {
        let mut body = CompactBody::default();
        while let Some(key) = access.next_key::<String>()? {
            // A repeated key replaces the earlier value, as in a plain parse.
            body.ids.retain(|(k, _)| *k != key);
            if !ID_FIELDS.contains(&key.as_str()) {
                body.map.insert(key, access.next_value()?);
                continue;
            }
            match access.next_value::<Field>()? {
                Field::Ids(ids) => {
                    body.map.shift_remove(&key);
                    body.ids.push((key, ids));
                }
                Field::Other(v) => {
                    body.map.insert(key, v);
                }
            }
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> CompactBody {
        serde_json::from_str(&v.to_string()).unwrap()
    }

    #[test]
    fn id_arrays_are_compact_and_everything_else_is_as_parsed() {
        let b = read(json!({"prompt": [1, 2, 4294967295u64], "n_predict": 3, "tokens": []}));
        assert_eq!(
            b.ids,
            [
                ("prompt".into(), vec![1, 2, u32::MAX]),
                ("tokens".into(), vec![])
            ]
        );
        assert_eq!(Value::Object(b.map), json!({"n_predict": 3}));
        for other in [
            json!({"prompt": [1, "text", 3]}),
            json!({"prompt": [[1, 2]]}),
            json!({"prompt": [1, 4294967296u64]}),
            json!({"prompt": [1, -1]}),
            json!({"prompt": [1.5]}),
            json!({"prompt": "text"}),
            json!({"prompt": {"a": [1]}}),
            json!({"prompt": null, "tokens": true}),
            json!({"messages": [1, 2]}),
        ] {
            let b = read(other.clone());
            assert!(b.ids.is_empty(), "{other}");
            assert_eq!(Value::Object(b.map), other);
        }
        // The last of repeated keys counts, whichever form each has.
        let b: CompactBody = serde_json::from_str(r#"{"prompt": [1], "prompt": "x"}"#).unwrap();
        assert!(b.ids.is_empty());
        assert_eq!(b.map["prompt"], "x");
        let b: CompactBody = serde_json::from_str(r#"{"prompt": "x", "prompt": [1]}"#).unwrap();
        assert_eq!(b.ids, [("prompt".into(), vec![1])]);
        assert!(!b.map.contains_key("prompt"));
        assert!(serde_json::from_str::<CompactBody>("[1]").is_err());
    }
}
