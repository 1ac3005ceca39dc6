//! Block formats against gguf-py's numpy implementation (testdata/quant_vectors.json, made by
//! tools/gen_quant_vectors.py) and the OCP FP8 definition.

use super::fp8::{dot_fp8_ref, f32_to_fp8_e4m3, fp8_e4m3_to_f32};
use super::nvfp4;
use super::*;
use serde_json::Value;

fn vectors() -> Value {
    let text = include_str!("../../testdata/quant_vectors.json");
    serde_json::from_str(text).expect("quant vectors parse")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn every_block_type_matches_gguf_py_bit_for_bit() {
    let v = vectors();
    let blocks = v["blocks"].as_array().unwrap();
    let mut seen = Vec::new();
    for case in blocks {
        let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(ty.name(), case["type"].as_str().unwrap());
        let bytes = hex(case["bytes_hex"].as_str().unwrap());
        let want = f32s(&case["dequant"]);
        let mut got = vec![0f32; want.len()];
        dequantize_ref(ty, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "{ty} element {i}: got {g}, gguf-py {w}");
        }
        // The dot product: the oracle sums the same dequantized values in f64; only the final cast differs.
        let x = f32s(&case["x"]);
        let dot = dot_ref(ty, &bytes, &x).unwrap();
        let want_dot = case["dot"].as_f64().unwrap();
        assert!(
            (f64::from(dot) - want_dot).abs() <= 1e-6 * want_dot.abs().max(1.0),
            "{ty} dot: {dot} vs {want_dot}"
        );
        seen.push(ty);
    }
    for ty in GgmlType::ALL.iter().filter(|t| t.has_reference_kernel()) {
        assert!(seen.contains(ty), "{ty} has a kernel but no test vector");
    }
}

#[test]
fn rejects_bad_lengths_and_unsupported_types() {
    let mut out = [0f32; 32];
    assert_eq!(
        dequantize_ref(GgmlType::Q4_1, &[0; 19], &mut out),
        Err(QuantError::Length {
            ty: GgmlType::Q4_1,
            n: 32,
            expected: 20,
            got: 19
        })
    );
    assert!(matches!(
        dequantize_ref(GgmlType::Q4_1, &[0; 20], &mut out[..31]),
        Err(QuantError::PartialBlock { .. })
    ));
    assert_eq!(
        dot_ref(GgmlType::Q5_K, &[], &[]),
        Err(QuantError::Unsupported(GgmlType::Q5_K))
    );
    assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
    assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
}

#[test]
fn type_table_is_consistent() {
    for &ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty as u32), Some(ty));
        assert!(ty.block_size() > 0 && ty.type_size() > 0 && ty.block_size() <= MAX_BLOCK);
    }
    assert_eq!(GgmlType::from_id(4), None);
    assert_eq!(GgmlType::from_id(u32::MAX), None);
}

#[test]
fn fp8_e4m3_decodes_all_256_codes() {
    let v = vectors();
    for (code, want) in v["fp8_e4m3"]["decode"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let got = fp8_e4m3_to_f32(code as u8);
        match want.as_f64() {
            Some(w) => assert_eq!(got, w as f32, "code {code:#04x}"),
            None => assert!(got.is_nan(), "code {code:#04x} should be NaN"),
        }
    }
    assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
    assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
}

#[test]
fn fp8_e4m3_encodes_round_to_nearest_even_with_saturation() {
    let v = vectors();
    for pair in v["fp8_e4m3"]["encode"].as_array().unwrap() {
        let x = pair[0].as_f64().unwrap() as f32;
        let want = pair[1].as_u64().unwrap() as u8;
        assert_eq!(f32_to_fp8_e4m3(x), want, "encode {x}");
    }
    assert_eq!(f32_to_fp8_e4m3(f32::INFINITY), 0x7E);
    assert_eq!(f32_to_fp8_e4m3(f32::NEG_INFINITY), 0xFE);
    assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7F);
    // Every finite code survives a round trip.
    for code in 0..=255u8 {
        let x = fp8_e4m3_to_f32(code);
        if !x.is_nan() {
            let back = f32_to_fp8_e4m3(x);
            assert_eq!(fp8_e4m3_to_f32(back), x, "code {code:#04x}");
        }
    }
}

#[test]
fn fp8_dot_matches_dequantized_dot() {
    let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7F != 0x7F).collect();
    let x: Vec<f32> = (0..codes.len()).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut deq = vec![0f32; codes.len()];
    fp8::dequantize_fp8_ref(&codes, 0.5, &mut deq);
    let want: f64 = deq
        .iter()
        .zip(&x)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    assert!((f64::from(dot_fp8_ref(&codes, 0.5, &x)) - want).abs() < 1e-4);
}

#[test]
fn nvfp4_quantize_round_trips_within_half_a_step() {
    let data: Vec<f32> = (0..256)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
        .collect();
    let ts = nvfp4::tensor_scale(&data);
    let mut q = vec![0u8; 256 / nvfp4::BLOCK * nvfp4::BLOCK_BYTES];
    nvfp4::quantize_ggml_ref(&data, ts, &mut q);
    let mut back = vec![0f32; 256];
    dequantize_ref(GgmlType::NVFP4, &q, &mut back).unwrap();
    for (sub, (x, y)) in data.chunks(16).zip(back.chunks(16)).enumerate() {
        let block = sub / 4;
        let scale = nvfp4::ue4m3_to_f32(q[block * 36 + sub % 4]) * ts;
        for (a, b) in x.iter().zip(y) {
            let b = b * ts;
            // The largest gap between E2M1 neighbours is 2 (4 -> 6), so the error is at most one scale unit,
            // plus the E4M3 rounding of the scale itself (< 1/16 relative) on the largest element.
            assert!(
                (a - b).abs() <= scale * 1.0 + a.abs() / 16.0 + 1e-6,
                "{a} vs {b} (scale {scale})"
            );
        }
    }
    // Quantizing the dequantized values again gives the same bytes: the grid is a fixed point.
    let requant: Vec<f32> = back.iter().map(|v| v * ts).collect();
    let mut q2 = vec![0u8; q.len()];
    nvfp4::quantize_ggml_ref(&requant, ts, &mut q2);
    let mut back2 = vec![0f32; 256];
    dequantize_ref(GgmlType::NVFP4, &q2, &mut back2).unwrap();
    assert_eq!(back, back2);
}

#[test]
fn e2m1_encoding_is_nearest() {
    for (code, &v) in nvfp4::E2M1_VALUES.iter().enumerate() {
        if code != 8 {
            assert_eq!(nvfp4::f32_to_e2m1(v), code as u8, "value {v}");
        }
    }
    assert_eq!(nvfp4::f32_to_e2m1(100.0), 7);
    assert_eq!(nvfp4::f32_to_e2m1(-5.1), 15);
    assert_eq!(nvfp4::f32_to_e2m1(0.2), 0);
}
