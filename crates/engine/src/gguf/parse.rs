//! The GGUF byte-level parser. Every read is bounds-checked against the bytes that remain, and every count is
//! checked against the smallest size its elements could have *before* anything is allocated, so a hostile
//! header cannot make us allocate more than the file's own size.

use super::{Array, DEFAULT_ALIGNMENT, GgufError, MAX_DIMS, TensorInfo, Value};
use crate::quant::GgmlType;
use std::collections::HashSet;

const MAGIC: [u8; 4] = *b"GGUF";
/// Nested arrays deeper than this are rejected (real files use one level).
const MAX_ARRAY_DEPTH: u32 = 4;

pub(super) struct Parsed {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn malformed(&self, msg: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            offset: self.pos as u64,
            msg: msg.into(),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.left() as u64 {
            return Err(GgufError::Truncated {
                what: what.to_owned(),
                offset: self.pos as u64,
                need: n,
                left: self.left() as u64,
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` elements of at least `min_size` bytes each can still fit in the file.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<usize, GgufError> {
        match count.checked_mul(min_size) {
            Some(need) if need <= self.left() as u64 => Ok(count as usize),
            _ => Err(self.malformed(format!(
                "{what} count {count} cannot fit in the {} bytes left (each needs at least {min_size})",
                self.left()
            ))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let start = self.pos;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| GgufError::Malformed {
            offset: start as u64,
            msg: format!("{what} is not valid UTF-8 ({e})"),
        })
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>("uint8")?[0]),
            1 => Value::I8(self.array::<1>("int8")?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array("uint16")?)),
            3 => Value::I16(i16::from_le_bytes(self.array("int16")?)),
            4 => Value::U32(self.u32("uint32")?),
            5 => Value::I32(i32::from_le_bytes(self.array("int32")?)),
            6 => Value::F32(f32::from_le_bytes(self.array("float32")?)),
            7 => Value::Bool(self.bool()?),
            8 => Value::String(self.string("string value")?),
            9 => Value::Array(self.array_value(depth)?),
            10 => Value::U64(self.u64("uint64")?),
            11 => Value::I64(i64::from_le_bytes(self.array("int64")?)),
            12 => Value::F64(f64::from_le_bytes(self.array("float64")?)),
            other => return Err(self.malformed(format!("unknown metadata value type {other}"))),
        })
    }

    fn bool(&mut self) -> Result<bool, GgufError> {
        match self.array::<1>("bool")?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.malformed(format!("bool byte is {b}, expected 0 or 1"))),
        }
    }

    fn array_value(&mut self, depth: u32) -> Result<Array, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.malformed(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}")));
        }
        let ty = self.u32("array element type")?;
        let count = self.u64("array length")?;
        macro_rules! fixed {
            ($variant:ident, $t:ty, $n:literal) => {{
                let n = self.check_count(count, $n, "array")?;
                let raw = self.take((n * $n) as u64, "array")?;
                Array::$variant(
                    raw.chunks_exact($n)
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            0 => fixed!(U8, u8, 1),
            1 => fixed!(I8, i8, 1),
            2 => fixed!(U16, u16, 2),
            3 => fixed!(I16, i16, 2),
            4 => fixed!(U32, u32, 4),
            5 => fixed!(I32, i32, 4),
            6 => fixed!(F32, f32, 4),
            7 => {
                let n = self.check_count(count, 1, "array")?;
                Array::Bool((0..n).map(|_| self.bool()).collect::<Result<_, _>>()?)
            }
            8 => {
                let n = self.check_count(count, 8, "string array")?;
                Array::String(
                    (0..n)
                        .map(|_| self.string("array string"))
                        .collect::<Result<_, _>>()?,
                )
            }
            9 => {
                let n = self.check_count(count, 12, "nested array")?;
                Array::Array(
                    (0..n)
                        .map(|_| self.array_value(depth + 1))
                        .collect::<Result<_, _>>()?,
                )
            }
            10 => fixed!(U64, u64, 8),
            11 => fixed!(I64, i64, 8),
            12 => fixed!(F64, f64, 8),
            other => return Err(self.malformed(format!("unknown array element type {other}"))),
        })
    }
}

pub(super) fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::Version(version));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;

    // Smallest key/value: empty key (8) + type (4) + one byte.
    let n_kv = c.check_count(n_kv, 13, "metadata")?;
    let mut metadata = Vec::with_capacity(n_kv);
    let mut keys = HashSet::with_capacity(n_kv);
    for _ in 0..n_kv {
        let at = c.pos;
        let key = c.string("metadata key")?;
        let ty = c.u32("metadata value type")?;
        let value = c.value(ty, 0)?;
        if !keys.insert(key.clone()) {
            return Err(GgufError::Malformed {
                offset: at as u64,
                msg: format!("duplicate metadata key {key:?}"),
            });
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if *a != 0 && a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => {
            return Err(GgufError::Malformed {
                offset: 0,
                msg: format!(
                    "general.alignment must be a power-of-two uint32, found {}",
                    v.summary(32)
                ),
            });
        }
    };

    // Smallest tensor info: empty name (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    let n_tensors = c.check_count(n_tensors, 32, "tensor")?;
    let mut raw = Vec::with_capacity(n_tensors);
    let mut names = HashSet::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let bad = |msg: String| GgufError::Tensor {
            name: name.clone(),
            msg,
        };
        let n_dims = c.u32("tensor rank")?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(bad(format!("rank {n_dims} is outside 1..={MAX_DIMS}")));
        }
        let dims = (0..n_dims)
            .map(|_| c.u64("tensor dimension"))
            .collect::<Result<Vec<_>, _>>()?;
        let type_id = c.u32("tensor type")?;
        let offset = c.u64("tensor offset")?;
        let ty = GgmlType::from_id(type_id)
            .ok_or_else(|| bad(format!("unknown ggml type id {type_id}")))?;
        if !names.insert(name.clone()) {
            return Err(bad("appears twice in the tensor table".into()));
        }
        raw.push((name, dims, ty, offset));
    }

    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    let file_len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, rel) in raw {
        let bad = |msg: String| GgufError::Tensor {
            name: name.clone(),
            msg,
        };
        if let Some(i) = dims.iter().position(|&d| d == 0) {
            return Err(bad(format!("dimension {i} is zero")));
        }
        let n = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        let block = ty.block_size() as u64;
        if dims[0] % block != 0 {
            return Err(bad(format!(
                "row length {} is not a multiple of the {ty} block size {block}",
                dims[0]
            )));
        }
        let size = (n / block)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| bad(format!("byte size of shape {dims:?} overflows")))?;
        if rel % alignment != 0 {
            return Err(bad(format!(
                "data offset {rel} is not aligned to {alignment}"
            )));
        }
        let offset = data_offset
            .checked_add(rel)
            .ok_or_else(|| bad(format!("data offset {rel} overflows")))?;
        match offset.checked_add(size) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(bad(format!(
                    "data [{offset}, +{size}) runs past the end of the file ({file_len} bytes); truncated download?"
                )));
            }
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size,
        });
    }

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}
