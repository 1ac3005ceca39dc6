//! Start-up checks that come before the model loads: a plugin directory that is not there, a port that
//! is taken, each a clear error at once; `--no-plugins`, the model alone.

use std::time::{Duration, Instant};

fn serve(args: &[&str]) -> (std::process::Output, Duration) {
    let t0 = Instant::now();
    let out = std::process::Command::new(thorn_tests::thorn_binary())
        .arg("serve")
        .arg("--model")
        .arg(thorn_tests::default_model())
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    (out, t0.elapsed())
}

#[test]
fn a_missing_plugin_directory_is_a_clear_start_up_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-plugins");
    let (out, _) = serve(&["--port", "0", "--plugins", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no-such-plugins") && err.contains("does not exist"),
        "{err}"
    );
    assert!(
        !err.to_lowercase().contains("backtrace"),
        "a user error, no backtrace: {err}"
    );
    assert!(
        err.starts_with("error: ") || err.contains("\nerror: "),
        "{err}"
    );
    // Nothing loaded first: the model's KV cache line comes after the checks.
    assert!(!err.contains("KV cache:"), "{err}");
}

#[test]
fn a_taken_port_is_reported_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (out, _) = serve(&["--host", "127.0.0.1", "--port", &port]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("listening on 127.0.0.1:{port}")),
        "{err}"
    );
    assert!(
        !err.contains("KV cache:"),
        "the model was not loaded: {err}"
    );
}

#[test]
fn no_plugins_serves_the_model_alone_and_plugins_commands_refuse_it() {
    let s = thorn_tests::ServeProcess::start(&["--no-plugins", "--plugin-poll", "0"]);
    let log = s.log();
    assert!(
        log.contains("0 plugin(s) with 0 tool(s) from (none: --no-plugins)"),
        "{log}"
    );
    assert!(!log.contains("plugin refused"), "{log}");
    drop(s);

    let both = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["serve", "--no-plugins", "--plugins", "/tmp"])
        .output()
        .unwrap();
    assert!(!both.status.success());
    let err = String::from_utf8_lossy(&both.stderr);
    assert!(err.contains("cannot be used with"), "{err}");

    let data = tempfile::tempdir().unwrap();
    let list = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["plugins", "list", "--no-plugins"])
        .env("THORN_DATA_DIR", data.path())
        .output()
        .unwrap();
    assert!(!list.status.success());
    let err = String::from_utf8_lossy(&list.stderr);
    assert!(
        err.contains("--no-plugins names no plugin directory"),
        "{err}"
    );
}
