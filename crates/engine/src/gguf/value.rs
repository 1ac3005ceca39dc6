//! GGUF metadata values.

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// UTF-8 `string`.
    String(String),
    /// A homogeneous `array`.
    Array(Array),
}

/// A homogeneous array, stored unboxed (a 49,152-entry vocabulary is one `Vec<String>`, not 49,152 `Value`s).
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// `uint8[]`.
    U8(Vec<u8>),
    /// `int8[]`.
    I8(Vec<i8>),
    /// `uint16[]`.
    U16(Vec<u16>),
    /// `int16[]`.
    I16(Vec<i16>),
    /// `uint32[]`.
    U32(Vec<u32>),
    /// `int32[]`.
    I32(Vec<i32>),
    /// `uint64[]`.
    U64(Vec<u64>),
    /// `int64[]`.
    I64(Vec<i64>),
    /// `float32[]`.
    F32(Vec<f32>),
    /// `float64[]`.
    F64(Vec<f64>),
    /// `bool[]`.
    Bool(Vec<bool>),
    /// `string[]`.
    String(Vec<String>),
    /// `array[]` (nested arrays).
    Array(Vec<Array>),
}

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// GGUF's name for the element type.
    pub fn elem_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "uint8",
            Array::I8(_) => "int8",
            Array::U16(_) => "uint16",
            Array::I16(_) => "int16",
            Array::U32(_) => "uint32",
            Array::I32(_) => "int32",
            Array::U64(_) => "uint64",
            Array::I64(_) => "int64",
            Array::F32(_) => "float32",
            Array::F64(_) => "float64",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
        }
    }
}

impl Value {
    /// GGUF's name for the type.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The value as a non-negative integer, whatever its integer width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float (f32 or f64 keys).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A short human rendering (arrays are summarised), for `thorn model info`.
    pub fn summary(&self, max_chars: usize) -> String {
        let s = match self {
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => match a {
                Array::String(v) if v.len() <= 8 => format!("{v:?}"),
                _ => format!("[{} x {}]", a.len(), a.elem_type_name()),
            },
            Value::U8(v) => v.to_string(),
            Value::I8(v) => v.to_string(),
            Value::U16(v) => v.to_string(),
            Value::I16(v) => v.to_string(),
            Value::U32(v) => v.to_string(),
            Value::I32(v) => v.to_string(),
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F32(v) => format!("{v:e}"),
            Value::F64(v) => format!("{v:e}"),
            Value::Bool(v) => v.to_string(),
        };
        if s.chars().count() > max_chars {
            let cut: String = s.chars().take(max_chars).collect();
            format!("{cut}...")
        } else {
            s
        }
    }
}
