//! Typed GGUF metadata: value types, values and the ordered key/value table.

use std::collections::HashMap;

/// The type of a metadata value, with the numeric ids GGUF files use (0..=12).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetaType {
    /// id 0
    U8,
    /// id 1
    I8,
    /// id 2
    U16,
    /// id 3
    I16,
    /// id 4
    U32,
    /// id 5
    I32,
    /// id 6
    F32,
    /// id 7 (stored as one byte, 0 or 1)
    Bool,
    /// id 8 (u64 length + UTF-8 bytes)
    String,
    /// id 9 (element type u32 + u64 count + elements)
    Array,
    /// id 10
    U64,
    /// id 11
    I64,
    /// id 12
    F64,
}

impl MetaType {
    /// Every type, in id order.
    pub const ALL: [MetaType; 13] = [
        MetaType::U8,
        MetaType::I8,
        MetaType::U16,
        MetaType::I16,
        MetaType::U32,
        MetaType::I32,
        MetaType::F32,
        MetaType::Bool,
        MetaType::String,
        MetaType::Array,
        MetaType::U64,
        MetaType::I64,
        MetaType::F64,
    ];

    /// The type with GGUF id `id`, or `None` outside 0..=12.
    pub fn from_id(id: u32) -> Option<MetaType> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// The GGUF id of this type.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes of one value for fixed-size types, `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            MetaType::U8 | MetaType::I8 | MetaType::Bool => Some(1),
            MetaType::U16 | MetaType::I16 => Some(2),
            MetaType::U32 | MetaType::I32 | MetaType::F32 => Some(4),
            MetaType::U64 | MetaType::I64 | MetaType::F64 => Some(8),
            MetaType::String | MetaType::Array => None,
        }
    }

    /// The fewest bytes one value of this type can occupy inside an array (an empty string is
    /// its 8-byte length; an empty array is its 4-byte element type and 8-byte count).
    pub(crate) fn min_size(self) -> u64 {
        match self {
            MetaType::String => 8,
            MetaType::Array => 12,
            t => t.fixed_size().unwrap_or(1) as u64,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// u8
    U8(u8),
    /// i8
    I8(i8),
    /// u16
    U16(u16),
    /// i16
    I16(i16),
    /// u32
    U32(u32),
    /// i32
    I32(i32),
    /// u64
    U64(u64),
    /// i64
    I64(i64),
    /// f32
    F32(f32),
    /// f64
    F64(f64),
    /// bool
    Bool(bool),
    /// UTF-8 string. The reader replaces invalid UTF-8 in string *values* by U+FFFD.
    String(String),
    /// Array: the element type and the elements, all of that type (nested arrays allowed).
    Array(MetaType, Vec<MetaValue>),
}

impl MetaValue {
    /// The string, for `String` values.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits in an i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Floats and integers, converted to f64 (large 64-bit integers round).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            ref other => other.as_i64().map(|v| v as f64),
        }
    }

    /// The bool, for `Bool` values.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, for `Array` values.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The type of this value.
    pub fn meta_type(&self) -> MetaType {
        match self {
            MetaValue::U8(_) => MetaType::U8,
            MetaValue::I8(_) => MetaType::I8,
            MetaValue::U16(_) => MetaType::U16,
            MetaValue::I16(_) => MetaType::I16,
            MetaValue::U32(_) => MetaType::U32,
            MetaValue::I32(_) => MetaType::I32,
            MetaValue::U64(_) => MetaType::U64,
            MetaValue::I64(_) => MetaType::I64,
            MetaValue::F32(_) => MetaType::F32,
            MetaValue::F64(_) => MetaType::F64,
            MetaValue::Bool(_) => MetaType::Bool,
            MetaValue::String(_) => MetaType::String,
            MetaValue::Array(..) => MetaType::Array,
        }
    }
}

/// The metadata of a GGUF file: key/value entries in file order, with an index by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, MetaValue)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// An empty table.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// All entries in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// A non-negative integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// An integer of any integer type whose value fits in a u32.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        u32::try_from(self.get_u64(key)?).ok()
    }

    /// An integer of any integer type whose value fits in an i64.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// A float or integer, as f32.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f64().map(|v| v as f32)
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// An array's elements.
    pub fn get_array(&self, key: &str) -> Option<&[MetaValue]> {
        self.get(key)?.as_array()
    }

    /// An array of strings; `None` if missing, not an array, or any element is not a string.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get_array(key)?.iter().map(MetaValue::as_str).collect()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// Sets `key`: replaces the value in place if present, else appends. Returns the old value.
    pub fn insert(&mut self, key: impl Into<String>, value: MetaValue) -> Option<MetaValue> {
        let key = key.into();
        if let Some(&i) = self.index.get(&key) {
            return Some(std::mem::replace(&mut self.entries[i].1, value));
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        None
    }

    /// Removes `key`, keeping the order of the others. Returns its value.
    pub fn remove(&mut self, key: &str) -> Option<MetaValue> {
        let i = self.index.remove(key)?;
        let (_, value) = self.entries.remove(i);
        for (k, _) in &self.entries[i..] {
            if let Some(slot) = self.index.get_mut(k) {
                *slot -= 1;
            }
        }
        Some(value)
    }

    /// Appends an entry read from a file; `false` if the key is already present.
    pub(crate) fn push_new(&mut self, key: String, value: MetaValue) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.entries.reserve(n);
        self.index.reserve(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_type_ids_round_trip() {
        for (i, t) in MetaType::ALL.iter().enumerate() {
            assert_eq!(t.id(), i as u32);
            assert_eq!(MetaType::from_id(i as u32), Some(*t));
        }
        assert_eq!(MetaType::from_id(13), None);
        assert_eq!(MetaType::from_id(u32::MAX), None);
    }

    #[test]
    fn conversions() {
        assert_eq!(MetaValue::I8(-1).as_u64(), None);
        assert_eq!(MetaValue::I8(-1).as_i64(), Some(-1));
        assert_eq!(MetaValue::I32(7).as_u64(), Some(7));
        assert_eq!(MetaValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetaValue::U64(u64::MAX).as_u64(), Some(u64::MAX));
        assert_eq!(MetaValue::U16(3).as_f64(), Some(3.0));
        assert_eq!(MetaValue::F32(1.5).as_f64(), Some(1.5));
        assert_eq!(MetaValue::F32(1.5).as_u64(), None);
        assert_eq!(MetaValue::Bool(true).as_u64(), None);
        assert_eq!(MetaValue::Bool(true).as_bool(), Some(true));
        assert_eq!(MetaValue::String("x".into()).as_str(), Some("x"));
        assert_eq!(MetaValue::String("x".into()).as_array(), None);
        let arr = MetaValue::Array(MetaType::U8, vec![MetaValue::U8(1)]);
        assert_eq!(arr.as_array().map(<[_]>::len), Some(1));
        assert_eq!(arr.meta_type(), MetaType::Array);
    }

    #[test]
    fn metadata_accessors_and_order() {
        let mut m = Metadata::new();
        assert!(m.is_empty());
        m.insert("general.architecture", MetaValue::String("gpt-oss".into()));
        m.insert("a.u", MetaValue::U64(1 << 40));
        m.insert("a.i", MetaValue::I32(-5));
        m.insert("a.f", MetaValue::F64(0.25));
        m.insert("a.b", MetaValue::Bool(false));
        m.insert(
            "a.s",
            MetaValue::Array(
                MetaType::String,
                vec![MetaValue::String("x".into()), MetaValue::String("y".into())],
            ),
        );
        m.insert(
            "a.mixed",
            MetaValue::Array(MetaType::U8, vec![MetaValue::U8(1)]),
        );
        assert_eq!(m.architecture(), Some("gpt-oss"));
        assert_eq!(m.get_u64("a.u"), Some(1 << 40));
        assert_eq!(m.get_u32("a.u"), None);
        assert_eq!(m.get_u32("a.i"), None);
        assert_eq!(m.get_i64("a.i"), Some(-5));
        assert_eq!(m.get_f32("a.i"), Some(-5.0));
        assert_eq!(m.get_f32("a.f"), Some(0.25));
        assert_eq!(m.get_bool("a.b"), Some(false));
        assert_eq!(m.get_str_array("a.s"), Some(vec!["x", "y"]));
        assert_eq!(m.get_str_array("a.mixed"), None);
        assert_eq!(m.get_str_array("missing"), None);
        // Replacing keeps the position; removing keeps the others' order.
        assert_eq!(
            m.insert("a.u", MetaValue::U8(2)),
            Some(MetaValue::U64(1 << 40))
        );
        assert_eq!(m.remove("a.i"), Some(MetaValue::I32(-5)));
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(
            keys,
            [
                "general.architecture",
                "a.u",
                "a.f",
                "a.b",
                "a.s",
                "a.mixed"
            ]
        );
        assert_eq!(m.get_u32("a.u"), Some(2));
        assert_eq!(m.get_f32("a.f"), Some(0.25));
        assert_eq!(m.len(), 6);
    }
}
