//! A small GGUF v3 writer: tests, fuzz seeds and tiny in-code models are built with it.

use super::{Array, DEFAULT_ALIGNMENT, Value};
use crate::quant::GgmlType;

/// Builds a GGUF v3 image in memory.
#[derive(Debug, Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufBuilder {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn kv(mut self, key: &str, value: Value) -> Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    /// Adds a tensor (dims in ggml order) with its raw bytes.
    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_owned(), dims.to_vec(), ty, data));
        self
    }

    /// Serializes the file.
    pub fn build(&self) -> Vec<u8> {
        let align = self
            .metadata
            .iter()
            .find_map(|(k, v)| match (k.as_str(), v) {
                ("general.alignment", Value::U32(a)) => Some(u64::from(*a)),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT)
            .max(1) as usize;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(align);
        }
        let data_start = out.len().next_multiple_of(align);
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn array_type(a: &Array) -> u32 {
    match a {
        Array::U8(_) => 0,
        Array::I8(_) => 1,
        Array::U16(_) => 2,
        Array::I16(_) => 3,
        Array::U32(_) => 4,
        Array::I32(_) => 5,
        Array::F32(_) => 6,
        Array::Bool(_) => 7,
        Array::String(_) => 8,
        Array::Array(_) => 9,
        Array::U64(_) => 10,
        Array::I64(_) => 11,
        Array::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&array_type(a).to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|x| put_array(out, x)),
    }
}
