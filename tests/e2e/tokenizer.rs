//! The tokenizer against llama.cpp's own tokenization of the default model (tests/data/smollm2).

use thorn_engine::gguf::Gguf;
use thorn_engine::tokenizer::Tokenizer;
use thorn_tests::{default_model, jsonl, token_ids as ids};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn reproduces_every_fixture_case() {
    let g = Gguf::open(default_model()).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let cases = jsonl("smollm2/tokenize.jsonl");
    assert_eq!(cases.len(), 162);
    let mut failures = Vec::new();
    for case in &cases {
        let id = case["id"].as_u64().unwrap();
        let want = ids(&case["ids"]);
        // Every piece's raw bytes.
        for (i, (&t, piece)) in want
            .iter()
            .zip(case["pieces_hex"].as_array().unwrap())
            .enumerate()
        {
            if tok.token_bytes(t) != hex(piece.as_str().unwrap()).as_slice() {
                failures.push(format!("case {id}: bytes of piece {i} (token {t})"));
            }
        }
        if case["category"] == "decode_partial_utf8" {
            if tok.decode_bytes(&want, true) != hex(case["decoded_hex"].as_str().unwrap()) {
                failures.push(format!("case {id}: partial UTF-8 bytes"));
            }
            // Streaming must hold the incomplete character back rather than emit a broken one.
            let mut d = tok.detokenizer(true);
            let mut out = String::new();
            for &t in &want {
                d.push(t, &mut out);
            }
            if !out.is_empty() || !d.has_pending() {
                failures.push(format!(
                    "case {id}: detokenizer emitted {out:?} for an incomplete character"
                ));
            }
            continue;
        }
        let text = case["text"].as_str().unwrap();
        let special = case["special"].as_bool().unwrap();
        let got = tok.encode(text, special).unwrap();
        if got != want {
            failures.push(format!(
                "case {id} ({text:?}, special={special}): got {got:?}, want {want:?}"
            ));
        }
        let decoded = case["decoded"].as_str().unwrap();
        if tok.decode(&want, true) != decoded {
            failures.push(format!(
                "case {id}: decode gave {:?}, want {decoded:?}",
                tok.decode(&want, true)
            ));
        }
        // Token-by-token streaming reassembles the exact text, and every delta is whole characters.
        let mut d = tok.detokenizer(true);
        let mut out = String::new();
        for &t in &want {
            d.push(t, &mut out);
        }
        d.finish(&mut out);
        if out != decoded {
            failures.push(format!("case {id}: streaming gave {out:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 162 cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn special_tokens_and_eog() {
    let g = Gguf::open(default_model()).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(
        (tok.bos(), tok.eos(), tok.add_bos()),
        (Some(1), Some(2), false)
    );
    assert_eq!(tok.eog(), &[0, 2]);
    assert_eq!(
        tok.encode("<|im_start|>assistant\n", true).unwrap(),
        vec![1, 520, 9531, 198]
    );
    assert!(tok.is_control(1) && !tok.is_control(520));
    // Hidden when not rendering special tokens (what a chat response shows).
    assert_eq!(tok.decode(&[1, 520, 9531, 2], false), "assistant");
}
