//! Any byte string fed to the GGUF reader gives a clean error or a file whose every tensor slice is in
//! bounds; a tokenizer built from whatever metadata parsed never panics either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use thorn_engine::gguf::Gguf;
use thorn_engine::quant::{GgmlType, dequantize_ref};
use thorn_engine::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes(data.to_vec()) else { return };
    let mut row = Vec::new();
    for t in g.tensors() {
        let bytes = g.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.size);
        let (_, cols) = t.rows_cols();
        if t.ty.has_reference_kernel() && cols <= 4096 {
            row.resize(cols as usize, 0.0);
            let row_bytes = t.ty.row_bytes(cols as usize).unwrap();
            let _ = dequantize_ref(t.ty, &bytes[..row_bytes], &mut row);
        }
        let _ = GgmlType::from_id(t.ty as u32);
    }
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        if let Ok(ids) = tok.encode("<|im_start|>héllo 123", true) {
            let _ = tok.decode(&ids, true);
        }
    }
});
