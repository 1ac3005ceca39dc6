//! Shared helpers for thorn's end-to-end tests: where the model and fixtures are, and golden files.

use std::path::{Path, PathBuf};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// `../shared/fixtures/<rel>` beside the repository.
pub fn fixture(rel: &str) -> PathBuf {
    root().join("../shared/fixtures").join(rel)
}

/// Lines of a JSONL fixture.
pub fn jsonl(rel: &str) -> Vec<serde_json::Value> {
    let path = fixture(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

/// The default model, pulled by `thorn model pull` (CI does that before the tests).
pub fn default_model() -> PathBuf {
    let cache = thorn::store::cache_dir(None);
    thorn::store::default_model(&cache).unwrap_or_else(|e| {
        panic!("{e}\nThe end-to-end tests need the default model: run `cargo run --release -- model pull`.")
    })
}

/// Compares `actual` with `tests/golden/<name>`; with `BLESS=1` rewrites the file instead.
pub fn golden(name: &str, actual: &str) {
    let path = root().join("tests/golden").join(name);
    if std::env::var_os("BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("create golden dir");
        std::fs::write(&path, actual).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading golden {}: {e} (BLESS=1 creates it)",
            path.display()
        )
    });
    if want != actual {
        let diff: Vec<String> = want
            .lines()
            .zip(actual.lines())
            .enumerate()
            .filter(|(_, (w, a))| w != a)
            .take(10)
            .map(|(i, (w, a))| format!("line {}:\n  want: {w}\n  got:  {a}", i + 1))
            .collect();
        panic!(
            "{} differs from the output ({} vs {} lines); BLESS=1 rewrites it\n{}",
            path.display(),
            want.lines().count(),
            actual.lines().count(),
            diff.join("\n")
        );
    }
}

/// A JSON array of token ids.
pub fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// A test plugin component built by `tests/build.rs` (`calculator`, `hostile`, ...).
pub fn plugin_wasm(name: &str) -> PathBuf {
    let p = Path::new(env!("THORN_TEST_PLUGINS")).join(format!("{name}.wasm"));
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

/// A request sampled at temperature 1.0 with `seed`, for at most `max` tokens.
pub fn sampled(prompt: Vec<u32>, seed: u64, max: usize) -> thorn::engine::Request {
    thorn::engine::Request {
        sampling: thorn::sample::SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..thorn::sample::SamplingParams::default()
        },
        ..thorn::engine::Request::greedy(prompt, max)
    }
}
