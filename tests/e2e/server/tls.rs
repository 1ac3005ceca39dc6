//! HTTPS: `--tls-cert`/`--tls-key` serve the openai SDK (trusting a CA the test made, refused by a client
//! that trusts only the system's roots), a second thorn reaches the first as an `https://` upstream with
//! `--tls-ca` (and not without it), and SIGHUP serves a renewed certificate to the next connection.

use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};
use thorn_tests::{ServeProcess, TestCa};

/// `curl` over HTTPS trusting `ca` only: whether `/health` answered.
fn curl_ok(port: u16, ca: &Path) -> bool {
    std::process::Command::new("curl")
        .args(["-sS", "-m", "20", "--cacert"])
        .arg(ca)
        .arg(format!("https://127.0.0.1:{port}/health"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn wait_for_log(s: &ServeProcess, needle: &str) {
    let t0 = Instant::now();
    while !s.log().contains(needle) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no {needle:?} in:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn https_serves_the_sdk_an_https_upstream_and_a_renewed_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "ca1");
    let (cert, key) = ca.issue(dir.path(), "server");
    let a = ServeProcess::start(&[
        "--no-plugins",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let port = a.addr.port();
    assert!(
        a.log().contains("serving the OpenAI API on https://"),
        "{}",
        a.log()
    );
    assert!(curl_ok(port, &ca.cert), "{}", a.log());

    if let Some(python) = thorn_tests::client_python() {
        let base = format!("https://127.0.0.1:{port}");
        let r = thorn_tests::run_client(
            &python,
            "openai_tls.py",
            &[&base, ca.cert.to_str().unwrap()],
        );
        let plain = r["plain"].as_str().unwrap();
        assert!(!plain.is_empty(), "{r}");
        assert_eq!(r["streamed"], r["plain"], "{r}");
        let refused = r["untrusted_error"].as_str().unwrap_or_default();
        assert!(refused.to_lowercase().contains("certificate"), "{r}");
    }

    // A second thorn reaches the first as an https upstream, trusting the test's CA.
    let upstream = format!("a=https://127.0.0.1:{port}");
    let b = ServeProcess::start(&[
        "--no-plugins",
        "--upstream",
        &upstream,
        "--tls-ca",
        ca.cert.to_str().unwrap(),
    ]);
    assert!(
        b.log()
            .contains(&format!("upstream a: https://127.0.0.1:{port}/v1 serving")),
        "{}",
        b.log()
    );
    let models = thorn_tests::http(b.addr, "GET", "/v1/models", &[], b"").json();
    let remote = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .find(|id| id.starts_with("a/"))
        .unwrap_or_else(|| panic!("{models}"))
        .to_owned();
    let body = json!({"model": remote, "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4, "temperature": 0});
    let r = thorn_tests::http(
        b.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    drop(b);

    // Without the CA, the upstream's certificate is not trusted: reported at start, not fatal.
    let c = ServeProcess::start(&["--no-plugins", "--upstream", &upstream]);
    assert!(c.log().contains("warning:"), "{}", c.log());
    assert!(!c.log().contains("upstream a: https"), "{}", c.log());
    drop(c);

    // Renewal: a certificate from another CA in place, SIGHUP, and the next connection gets it.
    let ca2 = TestCa::new(dir.path(), "ca2");
    let (cert2, key2) = ca2.issue(dir.path(), "renewed");
    std::fs::copy(&cert2, &cert).unwrap();
    std::fs::copy(&key2, &key).unwrap();
    a.signal("HUP");
    wait_for_log(&a, "TLS certificate reloaded");
    assert!(curl_ok(port, &ca2.cert), "{}", a.log());
    assert!(!curl_ok(port, &ca.cert), "{}", a.log());

    // A bad pair is reported and the renewed certificate stays.
    std::fs::write(&key, "not a key").unwrap();
    a.signal("HUP");
    wait_for_log(&a, "TLS certificate not reloaded");
    assert!(curl_ok(port, &ca2.cert), "{}", a.log());
}

#[test]
fn a_bad_certificate_is_a_start_up_error() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "ca");
    let (cert, _) = ca.issue(dir.path(), "server");
    let (_, other_key) = ca.issue(dir.path(), "other");
    for (c, k, needle) in [
        (cert.clone(), other_key, "server.pem with"),
        (dir.path().join("missing.pem"), cert.clone(), "missing.pem"),
    ] {
        let out = std::process::Command::new(thorn_tests::thorn_binary())
            .args(["serve", "--no-plugins", "--port", "0", "--tls-cert"])
            .arg(&c)
            .arg("--tls-key")
            .arg(&k)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle) && err.starts_with("error: "), "{err}");
        assert!(!err.contains("KV cache:"), "before the model loads: {err}");
    }
    // One without the other is a usage error.
    let out = std::process::Command::new(thorn_tests::thorn_binary())
        .args(["serve", "--tls-cert", "x.pem"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-key"));
}

#[test]
fn an_external_mcp_server_over_https_is_reached_with_the_trusted_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "ca");
    let (cert, key) = ca.issue(dir.path(), "server");
    // A: a thorn serving the calculator at /mcp over HTTPS.
    let installed = dir.path().join("plugins");
    std::fs::create_dir_all(&installed).unwrap();
    let host = thorn_plugin::PluginHost::with_config(thorn_plugin::HostConfig::default()).unwrap();
    let entries = thorn_tests::install_plugins(&host, &installed, &["calculator"], |_| json!({}));
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, json!({ "plugins": entries }).to_string()).unwrap();
    let a = ServeProcess::start(&[
        "--plugins",
        installed.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    // B: its policy names A's /mcp as an external server.
    let empty = dir.path().join("none");
    std::fs::create_dir_all(&empty).unwrap();
    let b_policy = dir.path().join("b-policy.json");
    let url = format!("https://127.0.0.1:{}/mcp", a.addr.port());
    std::fs::write(
        &b_policy,
        json!({"mcp_servers": {"calc": {"url": url, "tools": ["evaluate"]}}}).to_string(),
    )
    .unwrap();
    let b = |extra: &[&str]| {
        let mut args = vec![
            "--plugins",
            empty.to_str().unwrap(),
            "--policy",
            b_policy.to_str().unwrap(),
        ];
        args.extend(extra);
        ServeProcess::start(&args)
    };
    let trusting = b(&["--tls-ca", ca.cert.to_str().unwrap()]);
    assert!(
        trusting
            .log()
            .contains("0 plugin(s) and 1 external MCP server(s) (not sandboxed) with 1 tool(s)"),
        "{}",
        trusting.log()
    );
    let v = thorn_tests::forced_host_call(trusting.addr, "thorn:calc_evaluate", "What is 6 * 7?");
    let calls = &v["thorn_host_tool_calls"];
    assert_eq!(calls[0]["name"], "calc_evaluate", "{v}");
    assert!(calls[0]["result"]["value"].is_number(), "{v}");
    drop(trusting);

    // Without the CA the server is refused, with the reason, and the rest serves.
    let doubting = b(&[]);
    let log = doubting.log();
    assert!(!log.contains("1 external MCP server"), "{log}");
    assert!(
        log.contains("plugin refused") && log.contains("calc"),
        "{log}"
    );
}
