//! Builds the plugins workspace (`plugins/`: the SDK, the example tools and the hostile test plugin) for
//! wasm32-wasip2, so the e2e tests run real components. The `.wasm` files land in
//! `$OUT_DIR/plugins/wasm32-wasip2/release/`, exported to the tests as `THORN_TEST_PLUGINS`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned();
    let plugins = root.join("plugins");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo")).join("plugins");
    println!("cargo:rerun-if-changed={}", plugins.display());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&plugins)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--target-dir",
        ])
        .arg(&out)
        // The outer build's flags and target settings are for the host, not for the guests.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .status()
        .expect("running cargo for the plugins");
    assert!(
        status.success(),
        "building the plugins for wasm32-wasip2 failed (is the target installed? `rustup target add wasm32-wasip2`)"
    );
    println!(
        "cargo:rustc-env=THORN_TEST_PLUGINS={}",
        out.join("wasm32-wasip2").join("release").display()
    );
}
