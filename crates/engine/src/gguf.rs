//! GGUF (v2 and v3, little-endian) reader: memory-mapped, with typed metadata and a checked tensor table.
//!
//! The whole file is mapped read-only; tensor data is handed out as borrowed byte slices, so weights stay
//! quantized in the page cache and are never copied. Parsing treats the file as hostile: every count and
//! length is checked against the bytes that remain before anything is allocated, arithmetic on sizes and
//! offsets is checked, and every tensor must lie inside the file, aligned, with a known type and a shape whose
//! first dimension is a whole number of blocks. A bad file yields a [`GgufError`] that says what and where,
//! never a panic.

mod parse;
mod value;
mod write;

pub use value::{Array, Value};
pub use write::GgufBuilder;

use crate::quant::GgmlType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The largest tensor rank ggml supports.
pub const MAX_DIMS: usize = 4;
/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// What can be wrong with a GGUF file.
#[derive(Debug, Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    /// A version other than 2 or 3 (or a big-endian file).
    #[error("unsupported GGUF version {0} (thorn reads little-endian v2 and v3)")]
    Version(u32),
    /// The file ends before a structure it declares.
    #[error("file truncated at byte {offset}: {what} needs {need} more bytes, {left} left")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where.
        offset: u64,
        /// Bytes needed.
        need: u64,
        /// Bytes left in the file.
        left: u64,
    },
    /// A structurally invalid value.
    #[error("malformed GGUF at byte {offset}: {msg}")]
    Malformed {
        /// Where.
        offset: u64,
        /// What is wrong.
        msg: String,
    },
    /// A tensor that cannot be used as declared.
    #[error("tensor {name:?}: {msg}")]
    Tensor {
        /// The tensor's name.
        name: String,
        /// What is wrong.
        msg: String,
    },
    /// A metadata key that is required but absent.
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    /// A metadata key with an unexpected type.
    #[error("metadata key {key:?} is {found}, expected {expected}")]
    KeyType {
        /// The key.
        key: String,
        /// What the caller wanted.
        expected: &'static str,
        /// What the file has.
        found: &'static str,
    },
    /// A tensor that is required but absent.
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous (input) dimension.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data from the start of the file (already checked to be in bounds and aligned).
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Rows (product of all dims but the first) and row length.
    pub fn rows_cols(&self) -> (u64, u64) {
        let cols = self.dims.first().copied().unwrap_or(1);
        (self.dims.iter().skip(1).product(), cols)
    }
}

/// Where the file's bytes live.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: metadata, tensor table and the (mapped) bytes behind it.
pub struct Gguf {
    bytes: Bytes,
    /// Format version (2 or 3).
    pub version: u32,
    /// Alignment of the data section.
    pub alignment: u64,
    /// Offset of the data section from the start of the file.
    pub data_offset: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // A file shorter than the fixed header cannot be mapped usefully (and empty files cannot be mapped).
        let len = file.metadata().map_err(io)?.len();
        if len < 24 {
            let bytes = std::fs::read(path).map_err(io)?;
            return Self::from_bytes(bytes);
        }
        let map = map_readonly(&file).map_err(io)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, fuzzing, files shipped in-band).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Self, GgufError> {
        let parsed = parse::parse(bytes.as_slice())?;
        let meta_index = parsed
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Gguf {
            bytes,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            meta_index,
            tensors: parsed.tensors,
            tensor_index,
        })
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::KeyType {
            key: key.to_owned(),
            expected,
            found: v.type_name(),
        }
    }

    /// An unsigned integer key (any unsigned or non-negative signed width).
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| Self::wrong(key, "an unsigned integer", v))
    }

    /// An unsigned integer key that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| Self::wrong(key, "a u32", v))
    }

    /// A float key (f32 or f64).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| Self::wrong(key, "a float", v))
    }

    /// A boolean key.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong(key, "a bool", v)),
        }
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, "a string", v)),
        }
    }

    /// A string-array key.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.require(key)? {
            Value::Array(Array::String(a)) => Ok(a),
            v => Err(Self::wrong(key, "an array of strings", v)),
        }
    }

    /// An i32-array key (token types).
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::I32(a)) => Ok(a),
            v => Err(Self::wrong(key, "an array of i32", v)),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// A key under the architecture's namespace: `arch_key("block_count")` reads `llama.block_count`.
    pub fn arch_u32(&self, suffix: &str) -> Result<u32, GgufError> {
        self.get_u32(&format!("{}.{suffix}", self.architecture()?))
    }

    /// Float key under the architecture's namespace.
    pub fn arch_f32(&self, suffix: &str) -> Result<f32, GgufError> {
        self.get_f32(&format!("{}.{suffix}", self.architecture()?))
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's table entry.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor(name.into()))
    }

    /// A tensor's raw (still quantized) bytes.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // In bounds by construction: parse() checked offset + size <= file length with checked arithmetic.
        &self.bytes.as_slice()[info.offset as usize..(info.offset + info.size) as usize]
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.size).sum()
    }

    /// Size of the file image.
    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }
}

#[expect(
    unsafe_code,
    reason = "mapping a file is unsafe by signature; see the note at the call site"
)]
pub(crate) fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the mapping is read-only and private to this process. Undefined behaviour could only arise if
    // another process truncated or rewrote the model file while it is mapped; model files are immutable
    // artifacts (content-addressed in thorn's cache), which is the contract every mmap-based loader relies on.
    unsafe { memmap2::Mmap::map(file) }
}

#[cfg(test)]
mod tests;
