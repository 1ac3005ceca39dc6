//! Writing a plugin outside thorn's tree, as a new author would: `thorn plugins new demo` in an empty
//! directory, `thorn plugins build`, `install --approve`, and a call through `thorn serve`. A core module
//! is refused with the target to build for.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn thorn(args: &[&str], env: &[(&str, &Path)]) -> (bool, String, String) {
    let mut c = Command::new(thorn_tests::thorn_binary());
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_plugin_written_outside_the_tree_is_built_installed_and_called() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let (ok, out, err) = thorn(
        &["plugins", "new", "demo", "--dir", work.to_str().unwrap()],
        &[],
    );
    assert!(ok, "{out}{err}");
    let krate = work.join("demo");
    for f in ["Cargo.toml", "src/lib.rs", ".cargo/config.toml"] {
        assert!(krate.join(f).is_file(), "{f}");
    }
    // Not a second time, and not with a name a request could not use.
    let (ok, _, err) = thorn(
        &["plugins", "new", "demo", "--dir", work.to_str().unwrap()],
        &[],
    );
    assert!(!ok && err.contains("already exists"), "{err}");
    let (ok, _, err) = thorn(
        &[
            "plugins",
            "new",
            "Bad-Name",
            "--dir",
            work.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!ok && err.contains("is not a plugin name"), "{err}");

    // Built into thorn's target directory, so the SDK's dependencies are compiled once across runs.
    let target = thorn_tests::root().join("target/plugin-authoring");
    let (ok, out, err) = thorn(
        &["plugins", "build", krate.to_str().unwrap()],
        &[("CARGO_TARGET_DIR", &target)],
    );
    assert!(ok, "{out}{err}");
    let wasm = out.lines().last().unwrap_or_default().trim().to_owned();
    assert!(
        wasm.ends_with("demo.wasm") && Path::new(&wasm).is_file(),
        "{out}"
    );

    let (plugins, policy) = (dir.path().join("plugins"), dir.path().join("policy.json"));
    let place = [
        "--plugins",
        plugins.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
    ];
    let mut install = vec!["plugins", "install", wasm.as_str(), "--approve"];
    install.extend(place);
    let (ok, out, err) = thorn(&install, &[]);
    assert!(ok, "{out}{err}");

    // A core module is refused with what to build it for.
    let core = dir.path().join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let mut install_core = vec!["plugins", "install", core.to_str().unwrap(), "--approve"];
    install_core.extend(place);
    let (ok, _, err) = thorn(&install_core, &[]);
    assert!(
        !ok && err.contains("core WebAssembly module") && err.contains("wasm32-wasip2"),
        "{err}"
    );

    let s = thorn_tests::ServeProcess::start(&place);
    let v = thorn_tests::forced_host_call(s.addr, "thorn:demo", "Shout hello.");
    let call = &v["thorn_host_tool_calls"][0];
    assert_eq!(call["name"], "shout", "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    let said = args["text"].as_str().unwrap();
    assert_eq!(
        call["result"]["text"],
        format!("{}!", said.trim().to_uppercase()),
        "{v}"
    );
}
