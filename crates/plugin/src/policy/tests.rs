use super::*;
use serde_json::json;

fn manifest(capabilities: Value) -> Manifest {
    Manifest {
        name: "p".into(),
        version: "1".into(),
        description: String::new(),
        functions: Vec::new(),
        capabilities,
    }
}

const SHA: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

fn policy(dir: &Path, entry: Value) -> Policy {
    let doc = json!({"defaults": {"timeout_ms": 750}, "plugins": {"p": entry}});
    Policy::parse(&dir.join("policy.json"), &doc.to_string()).unwrap()
}

#[test]
fn refuses_unknown_changed_and_ungranted_plugins() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("docs")).unwrap();
    let m = manifest(json!({
        "filesystem": [{"path": "/data", "access": "read-write"}],
        "env": ["A", "B"],
        "network": ["api.example:443"]
    }));
    let e = Policy::none().grant(&m, SHA).unwrap_err();
    assert!(matches!(e, PolicyError::NotApproved { .. }), "{e}");
    let p = policy(dir.path(), json!({"sha256": "b".repeat(64)}));
    let e = p.grant(&m, SHA).unwrap_err();
    assert!(matches!(e, PolicyError::Changed { .. }), "{e}");
    let p = policy(
        dir.path(),
        json!({"sha256": SHA, "filesystem": [{"guest": "/data", "host": "docs", "access": "read"}],
               "env": {"A": "1"}, "network": ["api.example:80"]}),
    );
    let e = p.grant(&m, SHA).unwrap_err();
    let msg = e.to_string();
    let PolicyError::Denied { missing, .. } = e else {
        panic!("{msg}")
    };
    assert_eq!(
        missing,
        [
            "directory /data read-write (the policy grants it read-only)",
            "env B",
            "network api.example:443"
        ]
    );
}

#[test]
fn grants_exactly_what_is_asked_and_allowed() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("docs")).unwrap();
    let m = manifest(json!({
        "filesystem": [{"path": "/data", "access": "read"}],
        "env": ["A"],
        "network": ["127.0.0.1:8080"]
    }));
    let p = policy(
        dir.path(),
        json!({"sha256": SHA,
               "filesystem": [{"guest": "/data", "host": "docs", "access": "read-write"},
                              {"guest": "/other", "host": "docs", "access": "read"}],
               "env": {"A": "1", "UNASKED": "2"}, "network": ["127.0.0.1:*"],
               "limits": {"memory_mib": 16}}),
    );
    let g = p.grant(&m, SHA).unwrap();
    assert_eq!(
        g.preopens,
        [Preopen {
            host: dir.path().join("docs"),
            guest: "/data".into(),
            write: false
        }]
    );
    assert_eq!(g.env, [("A".to_owned(), "1".to_owned())]);
    assert_eq!(g.network.len(), 1);
    assert!(g.network[0].allows("127.0.0.1:8080".parse().unwrap()));
    assert!(!g.network[0].allows("127.0.0.1:8081".parse().unwrap()));
    assert!(!g.network[0].allows("127.0.0.2:8080".parse().unwrap()));
    assert_eq!(g.limits.memory, 16 << 20);
    assert_eq!(g.limits.timeout, Duration::from_millis(750));
    // A missing granted directory is a clear error, not a silent empty grant.
    let p = policy(
        dir.path(),
        json!({"sha256": SHA, "filesystem": [{"guest": "/data", "host": "nope", "access": "read"}],
               "env": {"A": "1"}, "network": ["127.0.0.1:*"]}),
    );
    assert!(matches!(p.grant(&m, SHA), Err(PolicyError::Grant { .. })));
}

#[test]
fn invalid_files_name_the_problem() {
    let path = Path::new("/x/policy.json");
    let e = Policy::parse(path, r#"{"plugins": {"p": {"sha256": "zz"}}}"#).unwrap_err();
    assert!(e.to_string().contains("/plugins/p/sha256"), "{e}");
    let e = Policy::parse(path, r#"{"plugin": {}}"#).unwrap_err();
    assert!(e.to_string().contains("plugin"), "{e}");
    let e = Policy::parse(
        path,
        &json!({"plugins": {"p": {"sha256": SHA, "network": ["no-port"]}}}).to_string(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("network"), "{e}");
}

#[test]
fn approve_pins_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    Policy::approve(&path, "p", SHA).unwrap();
    assert_eq!(Policy::load(&path).unwrap().pinned("p"), Some(SHA));
    let doc = json!({"defaults": {"timeout_ms": 10},
        "plugins": {"p": {"sha256": SHA, "env": {"A": "1"}}}});
    std::fs::write(&path, doc.to_string()).unwrap();
    let other = "c".repeat(64);
    Policy::approve(&path, "p", &other).unwrap();
    let p = Policy::load(&path).unwrap();
    assert_eq!(p.pinned("p"), Some(other.as_str()));
    assert_eq!(p.default_limits().timeout, Duration::from_millis(10));
    let again: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(again["plugins"]["p"]["env"]["A"], "1");
    assert_eq!(p.audit_path(), Some(dir.path().join("audit.jsonl")));
}

#[test]
fn net_rules_parse() {
    assert_eq!(
        NetRule::parse("Example.com:443"),
        Some(("example.com".into(), Some(443)))
    );
    assert_eq!(NetRule::parse("[::1]:*"), Some(("::1".into(), None)));
    assert_eq!(NetRule::parse("host"), None);
    assert_eq!(NetRule::parse(":80"), None);
    assert_eq!(NetRule::parse("h:99999"), None);
}

#[test]
fn mcp_servers_are_specs_with_their_bounds_and_no_secrets_shown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    std::fs::write(dir.path().join("tok"), "s3cret\n").unwrap();
    let text = |env_value: &str| {
        json!({"mcp_servers": {
            "weather": {"command": ["./bin/weather", "--metric"], "env": {"KEY": env_value},
                "tools": ["forecast"], "timeout_ms": 2500, "max_output_kib": 8},
            "tickets": {"url": "http://127.0.0.1:9000/mcp", "bearer_file": "tok", "tools": ["*"]},
            "nocred": {"url": "http://127.0.0.1:9001/mcp", "bearer_env": "THORN_NO_SUCH_VAR_SET",
                "tools": ["x"]}}})
        .to_string()
    };
    let p = Policy::parse(&path, &text("v1")).unwrap();
    assert_eq!(p.mcp_server_names(), ["nocred", "tickets", "weather"]);
    let specs = p.mcp_servers();
    let e = specs[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("THORN_NO_SUCH_VAR_SET"), "{e}");
    let tickets = specs[1].as_ref().unwrap();
    assert_eq!(tickets.tools, None, "\"*\" is every tool");
    assert!(matches!(&tickets.transport,
        ServerTransport::Http { bearer: Some(b), .. } if b == "s3cret"));
    assert!(!format!("{tickets:?}").contains("s3cret"), "{tickets:?}");
    let weather = specs[2].as_ref().unwrap();
    assert_eq!(weather.tools, Some(vec!["forecast".to_owned()]));
    assert_eq!(weather.timeout, Duration::from_millis(2500));
    assert_eq!(weather.startup, Duration::from_secs(30));
    assert_eq!((weather.max_output, weather.max_concurrent), (8 << 10, 4));
    let ServerTransport::Stdio {
        program,
        args,
        env,
        cwd,
    } = &weather.transport
    else {
        panic!("{weather:?}")
    };
    assert_eq!(program, &dir.path().join("./bin/weather"));
    assert_eq!(
        (args.as_slice(), cwd.as_deref()),
        (
            &["--metric".to_owned()][..],
            Some(dir.path().join(".").as_path())
        )
    );
    assert!(env.iter().any(|(k, v)| k == "KEY" && v == "v1"));
    assert!(
        env.iter().all(|(k, _)| k == "KEY" || k == "PATH"),
        "nothing else of the host's"
    );
    assert!(!format!("{weather:?}").contains("v1"));
    // The digest names the configuration, not its secrets.
    let again = Policy::parse(&path, &text("v2")).unwrap().mcp_servers();
    assert_eq!(again[2].as_ref().unwrap().sha256, weather.sha256);
    for bad in [
        json!({"mcp_servers": {"a_b": {"command": ["x"], "tools": []}}}),
        json!({"mcp_servers": {"a": {"command": ["x"], "url": "http://h/mcp", "tools": []}}}),
        json!({"mcp_servers": {"a": {"tools": []}}}),
        json!({"mcp_servers": {"a": {"command": ["x"]}}}),
        json!({"mcp_servers": {"a": {"url": "ftp://h", "tools": []}}}),
    ] {
        assert!(Policy::parse(&path, &bad.to_string()).is_err(), "{bad}");
    }
}

#[test]
fn approval_rules_layer_a_functions_over_its_plugins_and_bad_words_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = manifest(json!({}));
    let p = policy(
        dir.path(),
        json!({"sha256": SHA, "approval": "destructive", "approval_timeout_ms": 5000,
               "functions": {"wave": {"approval": "always", "approve_own": true}, "look": {"approval": "never"}}}),
    );
    let a = p.grant(&m, SHA).unwrap().approval;
    assert_eq!(a.rule("move").mode, crate::approval::Mode::Destructive);
    assert_eq!(a.rule("move").timeout, Duration::from_secs(5));
    assert!(!a.rule("move").approve_own);
    let wave = a.rule("wave");
    assert_eq!(
        (wave.mode, wave.timeout, wave.approve_own),
        (crate::approval::Mode::Always, Duration::from_secs(5), true)
    );
    assert_eq!(a.rule("look").mode, crate::approval::Mode::Never);
    // No entry: never, 60 s.
    let plain = policy(dir.path(), json!({"sha256": SHA}))
        .grant(&m, SHA)
        .unwrap();
    assert_eq!(plain.approval.rule("x"), &crate::ApprovalRule::default());
    let doc = json!({"plugins": {"p": {"sha256": SHA, "approval": "sometimes"}}});
    let e = Policy::parse(&dir.path().join("p.json"), &doc.to_string()).unwrap_err();
    assert!(e.to_string().contains("approval"), "{e}");
}

#[test]
fn remove_takes_out_one_entry_and_keeps_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.json");
    assert!(
        !Policy::remove(&path, "ghost").unwrap(),
        "no file: nothing removed"
    );
    assert!(!path.exists(), "and no file made");
    Policy::approve(&path, "a", SHA).unwrap();
    Policy::approve(&path, "b", SHA).unwrap();
    Policy::edit(&path, "b", |e| {
        e.insert("env".into(), json!({"K": "v"}));
    })
    .unwrap();
    assert!(Policy::remove(&path, "a").unwrap());
    assert!(!Policy::remove(&path, "a").unwrap(), "already gone");
    let p = Policy::load(&path).unwrap();
    assert_eq!(p.pinned("a"), None);
    assert_eq!(p.pinned("b"), Some(SHA));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"K\""), "{text}");
}
