//! `thorn plugins remove` and `revoke` with a server running: each change is audited before it is made,
//! and the server follows it at its next look (a removed plugin is dropped, a revoked grant is gone).

use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

fn thorn(plugins: &Path, policy: &Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(thorn_tests::thorn_binary())
        .arg("plugins")
        .args(args)
        .arg("--plugins")
        .arg(plugins)
        .arg("--policy")
        .arg(policy)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn health(addr: std::net::SocketAddr) -> Value {
    thorn_tests::http(addr, "GET", "/health", &[], b"").json()
}

/// Waits (at most a minute) until `/health` satisfies `ok`.
fn until(addr: std::net::SocketAddr, what: &str, ok: impl Fn(&Value) -> bool) {
    let t0 = Instant::now();
    loop {
        let h = health(addr);
        if ok(&h) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {h}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn audit(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("audit.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn remove_and_revoke_reach_a_running_server_and_are_audited() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = (dir.path().join("plugins"), dir.path().join("policy.json"));
    let docs = dir.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(docs.join("notes.txt"), "hello").unwrap();
    for p in ["calculator", "units", "files"] {
        let wasm = thorn_tests::plugin_wasm(p);
        let (ok, text) = thorn(
            &plugins,
            &policy,
            &["install", wasm.to_str().unwrap(), "--approve"],
        );
        assert!(ok, "{text}");
    }
    let grant = format!("/data={}", docs.display());
    let (ok, text) = thorn(&plugins, &policy, &["grant", "files", "--dir", &grant]);
    assert!(ok, "{text}");
    let s = thorn_tests::ServeProcess::start(&[
        "--plugins",
        plugins.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
        "--plugin-poll",
        "1",
    ]);
    until(s.addr, "three plugins", |h| h["plugins"] == 3);

    // Remove: the file and the policy entry go, the audit line first; the server drops the plugin.
    let (ok, text) = thorn(&plugins, &policy, &["remove", "units"]);
    assert!(ok, "{text}");
    assert!(!plugins.join("units.wasm").exists());
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&policy).unwrap()).unwrap();
    assert!(p["plugins"].get("units").is_none(), "{p}");
    let lines = audit(dir.path());
    let removed = lines.last().unwrap();
    assert_eq!(removed["phase"], "admin", "{removed}");
    assert_eq!(removed["function"], "remove", "{removed}");
    assert_eq!(removed["plugin"], "units", "{removed}");
    until(s.addr, "the removed plugin dropped", |h| h["plugins"] == 2);
    let body = json!({"messages": [{"role": "user", "content": "Convert 1 km to mi"}],
        "tools": [{"type": "function", "function": {"name": "thorn:units"}}], "max_tokens": 8});
    let r = thorn_tests::http(
        s.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 400, "{}", r.body);

    // Revoke: the directory grant goes; the files plugin asks for it, so the server refuses it now.
    let (ok, text) = thorn(&plugins, &policy, &["revoke", "files", "--dir", "/data"]);
    assert!(ok, "{text}");
    let p: Value = serde_json::from_str(&std::fs::read_to_string(&policy).unwrap()).unwrap();
    let fs = p["plugins"]["files"]["filesystem"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(fs.is_empty(), "{p}");
    let revoked = audit(dir.path()).last().cloned().unwrap();
    assert_eq!(revoked["function"], "revoke", "{revoked}");
    assert_eq!(revoked["args"]["dirs"], json!(["/data"]), "{revoked}");
    until(
        s.addr,
        "the files plugin refused without its directory",
        |h| h["plugins"] == 1,
    );

    // Mistakes are named, and change nothing.
    let before = std::fs::read_to_string(&policy).unwrap();
    for (args, needle) in [
        (
            vec!["revoke", "calculator", "--dir", "/nowhere"],
            "not granted the directory \"/nowhere\"",
        ),
        (vec!["revoke", "calculator"], "say what to revoke"),
        (vec!["revoke", "ghost", "--all"], "no entry for \"ghost\""),
        (vec!["remove", "ghost"], "no plugin \"ghost\" installed"),
    ] {
        let (ok, text) = thorn(&plugins, &policy, &args);
        assert!(!ok, "{args:?}: {text}");
        assert!(text.contains(needle), "{args:?}: {text}");
    }
    assert_eq!(std::fs::read_to_string(&policy).unwrap(), before);
}
