//! Where a `qwen35` model's weights come from: a GGUF file, or a Hugging Face checkpoint (config.json and
//! safetensors shards, the form NVFP4 checkpoints are published in).
//!
//! Both are read through [`Weights`], which speaks GGUF tensor names and llama.cpp's conventions; the HF
//! reader converts on the way in exactly as `convert_hf_to_gguf.py` does:
//!
//! * the `(1 + w)` RMSNorm weights (`input_layernorm`, `post_attention_layernorm`, `model.norm`, `q_norm`,
//!   `k_norm`) get their 1 added; the DeltaNet output norm (`linear_attn.norm`) is plain `w`;
//! * `A_log` becomes `ssm_a = -exp(A_log)`; `dt_bias` is `ssm_dt.bias`; `conv1d.weight [C, 1, K]` is `[C][K]`;
//! * DeltaNet value heads go from HF's grouped order (value head `j` reads key head `j / (vh/kh)`) to the
//!   tiled order (value head `n` reads key head `n % kh`): GGUF head `n = a·kh + b` is HF head `b·(vh/kh) + a`.
//!   That permutes the V rows of `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`,
//!   `dt_bias`, the V channels of `conv1d`, and the columns of `out_proj`.
//!
//! Tensor types: F32, F16, BF16, and ModelOpt NVFP4 (`weight` as packed E2M1 pairs with `weight_scale`
//! E4M3 per 16 inputs and the f32 `weight_scale_2`), dequantized at load.

use super::Qwen35Config;
use crate::backend::{Device, Matrix};
use crate::gguf::Gguf;
use crate::model::ModelError;
use crate::quant::dequantize_ref;
use crate::quant::fp8::fp8_e4m3_to_f32;
use crate::quant::nvfp4::E2M1_VALUES;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A source of weights by GGUF name.
pub trait Weights {
    /// Whether the output projection is the token embedding (no `output.weight`).
    fn tied_output(&self) -> bool;
    /// A tensor of `n` elements as f32.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError>;
    /// A matrix of `rows` outputs over `cols` inputs as row-major f32.
    fn matrix_f32(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ModelError>;
    /// A matrix in `dev`'s layout (kept in its stored type where the device's kernels have one).
    fn matrix(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        Ok(dev.matrix_f32(rows, cols, self.matrix_f32(name, rows, cols)?)?)
    }

    /// Rows `pick` (in that order) of a matrix of `rows` outputs over `cols` inputs, in `dev`'s layout.
    fn matrix_rows(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
        pick: &[usize],
    ) -> Result<Matrix, ModelError> {
        let f = self.matrix_f32(name, rows, cols)?;
        let picked = pick
            .iter()
            .flat_map(|&r| f[r * cols..(r + 1) * cols].iter().copied())
            .collect();
        Ok(dev.matrix_f32(pick.len(), cols, picked)?)
    }
}

fn shape_error(name: &str, got: Vec<u64>, want: Vec<u64>) -> ModelError {
    ModelError::Shape {
        name: name.into(),
        got,
        want,
    }
}

/// The GGUF tensor `name`, checked to be a matrix of `rows` outputs over `cols` inputs.
fn matrix_tensor<'g>(
    g: &'g Gguf,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<&'g crate::gguf::TensorInfo, ModelError> {
    let t = g.tensor(name)?;
    if t.rows_cols() != (rows as u64, cols as u64) || t.dims.len() != 2 {
        return Err(shape_error(
            name,
            t.dims.clone(),
            vec![cols as u64, rows as u64],
        ));
    }
    Ok(t)
}

impl Weights for Gguf {
    fn tied_output(&self) -> bool {
        self.tensor("output.weight").is_err()
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.tensor(name)?;
        if t.n_elements() != n as u64 {
            return Err(shape_error(name, t.dims.clone(), vec![n as u64]));
        }
        let mut v = vec![0f32; n];
        dequantize_ref(t.ty, self.tensor_data(t), &mut v)?;
        Ok(v)
    }

    fn matrix_f32(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ModelError> {
        let t = matrix_tensor(self, name, rows, cols)?;
        let mut w = vec![0f32; rows * cols];
        dequantize_ref(t.ty, self.tensor_data(t), &mut w)?;
        Ok(w)
    }

    fn matrix(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        let t = matrix_tensor(self, name, rows, cols)?;
        Ok(dev.matrix(t.ty, rows, cols, self.tensor_data(t))?)
    }

    fn matrix_rows(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
        pick: &[usize],
    ) -> Result<Matrix, ModelError> {
        let t = matrix_tensor(self, name, rows, cols)?;
        let rb = t.ty.row_bytes(cols).ok_or_else(|| {
            ModelError::Unsupported(format!("{name}: rows of {cols} weights of type {}", t.ty))
        })?;
        // Rows of block types are whole blocks: they are picked as stored.
        let data = self.tensor_data(t);
        let picked: Vec<u8> = pick
            .iter()
            .flat_map(|&r| data[r * rb..(r + 1) * rb].iter().copied())
            .collect();
        Ok(dev.matrix(t.ty, pick.len(), cols, &picked)?)
    }
}

/// A shared GGUF's weights: as the GGUF's, except that its matrices may stay in the file's mapping (see
/// [`Device::mapped_matrix`]), which they then keep alive.
impl Weights for std::sync::Arc<Gguf> {
    fn tied_output(&self) -> bool {
        (**self).tied_output()
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        (**self).vector(name, n)
    }

    fn matrix_f32(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ModelError> {
        (**self).matrix_f32(name, rows, cols)
    }

    fn matrix(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix, ModelError> {
        let t = matrix_tensor(self, name, rows, cols)?;
        let owner: std::sync::Arc<dyn Send + Sync> = std::sync::Arc::<Gguf>::clone(self);
        Ok(dev.mapped_matrix(t.ty, rows, cols, self.tensor_data(t), &owner)?)
    }

    fn matrix_rows(
        &self,
        dev: &Device,
        name: &str,
        rows: usize,
        cols: usize,
        pick: &[usize],
    ) -> Result<Matrix, ModelError> {
        (**self).matrix_rows(dev, name, rows, cols, pick)
    }
}

/// One tensor's place in a shard.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

/// A Hugging Face checkpoint directory: `config.json` and one or more safetensors files, memory mapped.
#[derive(Debug)]
pub struct HfCheckpoint {
    /// The directory.
    pub dir: PathBuf,
    /// The parsed `config.json` (the text model's part).
    pub config: serde_json::Value,
    shards: Vec<memmap2::Mmap>,
    index: HashMap<String, Entry>,
    /// The prefix of the text model's tensors (`model.` or `model.language_model.`).
    prefix: String,
    cfg: Option<Qwen35Config>,
}

fn bad(dir: &Path, msg: impl std::fmt::Display) -> ModelError {
    ModelError::Unsupported(format!("checkpoint {}: {msg}", dir.display()))
}

impl HfCheckpoint {
    /// Opens the checkpoint in `dir` (every `*.safetensors` file in it).
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| bad(dir, format!("config.json: {e}")))?;
        let mut config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(dir, format!("config.json: {e}")))?;
        if let Some(t) = config.get("text_config").cloned() {
            config = t;
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| bad(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(bad(dir, "no .safetensors files"));
        }
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let file = std::fs::File::open(f).map_err(|e| bad(dir, e))?;
            // Mapped read-only under the GGUF reader's contract (model files are immutable artifacts).
            let map = crate::gguf::map_readonly(&file).map_err(|e| bad(dir, e))?;
            let (n, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| bad(dir, format!("{}: {e}", f.display())))?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                if base + b > map.len() || a > b {
                    return Err(bad(dir, format!("tensor {name} lies outside its file")));
                }
                index.insert(
                    name,
                    Entry {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        range: (base + a, base + b),
                    },
                );
            }
            shards.push(map);
        }
        let prefix = ["model.language_model.", "model."]
            .into_iter()
            .find(|p| index.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| bad(dir, "no embed_tokens.weight"))?
            .to_string();
        let mut ck = HfCheckpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            index,
            prefix,
            cfg: None,
        };
        let mut cfg = Qwen35Config::from_hf(&ck.config)?;
        // Converted or pruned checkpoints may declare an MTP head they no longer carry.
        cfg.mtp &= ck.index.contains_key("mtp.fc.weight");
        ck.cfg = Some(cfg);
        Ok(ck)
    }

    /// The hyperparameters.
    pub fn qwen35_config(&self) -> &Qwen35Config {
        self.cfg.as_ref().expect("set at open")
    }

    fn entry(&self, name: &str) -> Result<&Entry, ModelError> {
        self.index
            .get(name)
            .ok_or_else(|| bad(&self.dir, format!("no tensor {name}")))
    }

    fn bytes(&self, e: &Entry) -> &[u8] {
        &self.shards[e.file][e.range.0..e.range.1]
    }

    /// HF tensor `name` as f32 with its HF shape (NVFP4 weights dequantized, their shape unpacked).
    fn read(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
        let e = self.entry(name)?;
        let b = self.bytes(e);
        let n: usize = e.shape.iter().product();
        let need = |k: usize| {
            if b.len() == n * k {
                Ok(())
            } else {
                Err(bad(&self.dir, format!("tensor {name}: wrong byte length")))
            }
        };
        let v: Vec<f32> = match e.dtype {
            Dtype::F32 => {
                need(4)?;
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            }
            Dtype::F16 => {
                need(2)?;
                b.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect()
            }
            Dtype::BF16 => {
                need(2)?;
                b.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect()
            }
            Dtype::U8 if name.ends_with(".weight") => return self.read_nvfp4(name, e),
            other => {
                return Err(bad(
                    &self.dir,
                    format!("tensor {name} has type {other:?} (F32, F16, BF16 or NVFP4)"),
                ));
            }
        };
        Ok((v, e.shape.clone()))
    }

    /// A ModelOpt NVFP4 weight: `[out, in/2]` bytes (column `2i` in the low nibble of byte `i`),
    /// `weight_scale` E4M3 `[out, in/16]`, `weight_scale_2` f32.
    fn read_nvfp4(&self, name: &str, e: &Entry) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
        let stem = name.trim_end_matches(".weight");
        let (rows, half_cols) = match e.shape[..] {
            [r, c] => (r, c),
            _ => return Err(bad(&self.dir, format!("NVFP4 tensor {name} is not 2-D"))),
        };
        let cols = 2 * half_cols;
        let se = self.entry(&format!("{stem}.weight_scale"))?;
        let s2 = self.entry(&format!("{stem}.weight_scale_2"))?;
        if se.dtype != Dtype::F8_E4M3
            || se.shape != [rows, cols / 16]
            || s2.dtype != Dtype::F32
            || s2.shape.iter().product::<usize>() != 1
        {
            return Err(bad(
                &self.dir,
                format!("NVFP4 tensor {name}: scales of the wrong type or shape"),
            ));
        }
        let scales = self.bytes(se);
        let s2b = self.bytes(s2);
        let global = f32::from_le_bytes([s2b[0], s2b[1], s2b[2], s2b[3]]);
        let packed = self.bytes(e);
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                let byte = packed[r * half_cols + c / 2];
                let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
                let scale = fp8_e4m3_to_f32(scales[r * (cols / 16) + c / 16]);
                out[r * cols + c] = E2M1_VALUES[usize::from(code)] * scale * global;
            }
        }
        Ok((out, vec![rows, cols]))
    }

    fn read_shaped(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (v, shape) = self.read(name)?;
        let squeezed: Vec<usize> = shape.iter().copied().filter(|&d| d != 1).collect();
        let want_sq: Vec<usize> = want.iter().copied().filter(|&d| d != 1).collect();
        if squeezed != want_sq {
            return Err(shape_error(
                name,
                shape.iter().map(|&d| d as u64).collect(),
                want.iter().map(|&d| d as u64).collect(),
            ));
        }
        Ok(v)
    }

    /// The HF tensor and conversion behind GGUF tensor `name`, read as f32 with `rows × cols` elements
    /// (`cols = 1` for vectors).
    fn convert(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ModelError> {
        let c = self.qwen35_config();
        let p = &self.prefix;
        let global = match name {
            "token_embd.weight" => Some((format!("{p}embed_tokens.weight"), false)),
            "output_norm.weight" => Some((format!("{p}norm.weight"), true)),
            "output.weight" => Some(if self.index.contains_key("lm_head.weight") {
                ("lm_head.weight".to_string(), false)
            } else {
                (format!("{p}embed_tokens.weight"), false)
            }),
            _ => None,
        };
        if let Some((hf, plus_one)) = global {
            let mut v = self.read_shaped(&hf, &[rows, cols])?;
            if plus_one {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            return Ok(v);
        }
        let bad_name = || bad(&self.dir, format!("no HF tensor for {name}"));
        let rest = name.strip_prefix("blk.").ok_or_else(bad_name)?;
        let (layer, what) = rest.split_once('.').ok_or_else(bad_name)?;
        // The MTP block follows the main layers (llama.cpp's nextn numbering); HF keeps it under `mtp.`.
        let is_mtp = layer.parse::<usize>().ok() == Some(c.n_layers);
        let l = if is_mtp {
            "mtp.layers.0.".to_string()
        } else {
            format!("{p}layers.{layer}.")
        };
        let nextn = match what {
            "nextn.eh_proj.weight" => Some(("mtp.fc.weight", false)),
            "nextn.enorm.weight" => Some(("mtp.pre_fc_norm_embedding.weight", true)),
            "nextn.hnorm.weight" => Some(("mtp.pre_fc_norm_hidden.weight", true)),
            "nextn.shared_head_norm.weight" => Some(("mtp.norm.weight", true)),
            _ => None,
        };
        if let (true, Some((hf, plus_one))) = (is_mtp, nextn) {
            let mut v = self.read_shaped(hf, &[rows, cols])?;
            if plus_one {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            return Ok(v);
        }
        // (HF name, +1 norm, value-head permutation: (block rows per head, first permuted row) or columns)
        enum Perm {
            None,
            Rows { from: usize, per_head: usize },
            Cols { per_head: usize },
        }
        let vdim = c.value_dim;
        let kdim2 = 2 * c.key_heads * c.key_dim;
        let (hf, plus_one, perm) = match what {
            "attn_norm.weight" => (format!("{l}input_layernorm.weight"), true, Perm::None),
            "post_attention_norm.weight" => (
                format!("{l}post_attention_layernorm.weight"),
                true,
                Perm::None,
            ),
            "ffn_gate.weight" => (format!("{l}mlp.gate_proj.weight"), false, Perm::None),
            "ffn_up.weight" => (format!("{l}mlp.up_proj.weight"), false, Perm::None),
            "ffn_down.weight" => (format!("{l}mlp.down_proj.weight"), false, Perm::None),
            "attn_q.weight" => (format!("{l}self_attn.q_proj.weight"), false, Perm::None),
            "attn_k.weight" => (format!("{l}self_attn.k_proj.weight"), false, Perm::None),
            "attn_v.weight" => (format!("{l}self_attn.v_proj.weight"), false, Perm::None),
            "attn_output.weight" => (format!("{l}self_attn.o_proj.weight"), false, Perm::None),
            "attn_q_norm.weight" => (format!("{l}self_attn.q_norm.weight"), true, Perm::None),
            "attn_k_norm.weight" => (format!("{l}self_attn.k_norm.weight"), true, Perm::None),
            "attn_qkv.weight" => (
                format!("{l}linear_attn.in_proj_qkv.weight"),
                false,
                Perm::Rows {
                    from: kdim2,
                    per_head: vdim,
                },
            ),
            "attn_gate.weight" => (
                format!("{l}linear_attn.in_proj_z.weight"),
                false,
                Perm::Rows {
                    from: 0,
                    per_head: vdim,
                },
            ),
            "ssm_alpha.weight" => (
                format!("{l}linear_attn.in_proj_a.weight"),
                false,
                Perm::Rows {
                    from: 0,
                    per_head: 1,
                },
            ),
            "ssm_beta.weight" => (
                format!("{l}linear_attn.in_proj_b.weight"),
                false,
                Perm::Rows {
                    from: 0,
                    per_head: 1,
                },
            ),
            "ssm_a" => (
                format!("{l}linear_attn.A_log"),
                false,
                Perm::Rows {
                    from: 0,
                    per_head: 1,
                },
            ),
            "ssm_dt.bias" => (
                format!("{l}linear_attn.dt_bias"),
                false,
                Perm::Rows {
                    from: 0,
                    per_head: 1,
                },
            ),
            "ssm_conv1d.weight" => (
                format!("{l}linear_attn.conv1d.weight"),
                false,
                Perm::Rows {
                    from: kdim2,
                    per_head: vdim,
                },
            ),
            "ssm_norm.weight" => (format!("{l}linear_attn.norm.weight"), false, Perm::None),
            "ssm_out.weight" => (
                format!("{l}linear_attn.out_proj.weight"),
                false,
                Perm::Cols { per_head: vdim },
            ),
            _ => return Err(bad_name()),
        };
        let mut v = self.read_shaped(&hf, &[rows, cols])?;
        if plus_one {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        if what == "ssm_a" {
            v.iter_mut().for_each(|x| *x = -x.exp());
        }
        // GGUF head n = a·kh + b is HF head b·r + a (r = vh / kh).
        let (kh, vh) = (c.key_heads, c.value_heads);
        let r = vh / kh.max(1);
        let hf_head = |n: usize| (n % kh) * r + n / kh;
        match perm {
            Perm::None => {}
            Perm::Rows { from, per_head } => {
                let src = v.clone();
                let row = per_head * cols;
                for n in 0..vh {
                    let (d, s) = (from * cols + n * row, from * cols + hf_head(n) * row);
                    v[d..d + row].copy_from_slice(&src[s..s + row]);
                }
            }
            Perm::Cols { per_head } => {
                let src = v.clone();
                for rr in 0..rows {
                    for n in 0..vh {
                        let (d, s) = (rr * cols + n * per_head, rr * cols + hf_head(n) * per_head);
                        v[d..d + per_head].copy_from_slice(&src[s..s + per_head]);
                    }
                }
            }
        }
        Ok(v)
    }
}

impl Weights for HfCheckpoint {
    fn tied_output(&self) -> bool {
        // `convert` falls back to the embeddings itself.
        false
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        if name.ends_with("ssm_conv1d.weight") {
            // `[channels, 1, kernel]`: permuted by channel rows.
            let c = self.qwen35_config();
            return self.convert(name, c.conv_dim(), n / c.conv_dim().max(1));
        }
        self.convert(name, n, 1)
    }

    fn matrix_f32(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, ModelError> {
        self.convert(name, rows, cols)
    }
}
