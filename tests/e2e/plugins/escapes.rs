//! Every way the hostile test plugin misbehaves, in the sandbox: runaway loops and memory, floods of
//! output, traps, name lookups outside its grant, planted symlinks, sockets past the resource cap; after
//! each, a normal call must still succeed.

use super::*;
/// The hostile plugin with a real grant: a directory, one env var and loopback TCP. Its deadline (3 s) is
/// far above what a legitimate call takes even on a loaded machine, and far below the runaway cases.
pub(super) fn hostile(data: &Path) -> Plugin {
    let limits = Limits {
        timeout: Duration::from_secs(3),
        memory: 32 << 20,
        stdio: 16 << 10,
        max_output: 64 << 10,
        ..Limits::default()
    };
    let grant = Grant {
        preopens: vec![Preopen {
            host: data.to_owned(),
            guest: "/data".into(),
            write: false,
        }],
        env: vec![("THORN_TEST_VAR".into(), "granted".into())],
        network: vec![NetRule {
            host: "127.0.0.1".into(),
            port: None,
            addrs: vec!["127.0.0.1".parse().unwrap()],
        }],
        limits,
        audit_arguments: false,
        rates: Default::default(),
        approval: Default::default(),
        deadman: Default::default(),
    };
    host().load_with(&plugin_wasm("hostile"), grant).unwrap()
}

fn still_serves(p: &Plugin) {
    assert_eq!(p.call("ok", &json!({"n": 41})).unwrap(), json!(42));
}

#[test]
fn hostile_plugins_are_stopped_with_clear_errors() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("inside.txt"), "granted text").unwrap();
    std::fs::write(root.path().join("outside.txt"), "not granted").unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let p = hostile(&data);

    // What the grant opens works.
    assert_eq!(
        p.call("read", &json!({"target": "/data/inside.txt"}))
            .unwrap(),
        "granted text"
    );
    assert_eq!(
        p.call("env", &json!({"target": "THORN_TEST_VAR"})).unwrap(),
        "granted"
    );
    assert_eq!(
        p.call("connect", &json!({"target": format!("127.0.0.1:{port}")}))
            .unwrap(),
        "connected"
    );

    type Expect = fn(&PluginError) -> bool;
    let cases: Vec<(&str, Value, Expect)> = vec![
        ("spin", json!({}), |e| {
            matches!(e, PluginError::Timeout { .. })
        }),
        ("sleep", json!({"n": 600_000}), |e| {
            matches!(e, PluginError::Timeout { .. })
        }),
        ("alloc", json!({}), |e| {
            matches!(e, PluginError::MemoryLimit { .. })
        }),
        (
            "recurse",
            json!({}),
            |e| matches!(e, PluginError::Trap { trap, .. } if trap.contains("stack")),
        ),
        (
            "panic",
            json!({}),
            |e| matches!(e, PluginError::Trap { stderr, .. } if stderr.contains("panicked on purpose")),
        ),
        ("read", json!({"target": "/etc/passwd"}), |e| {
            tool_error(e, "cannot read")
        }),
        // Escaping the granted directory with `..`.
        ("read", json!({"target": "/data/../outside.txt"}), |e| {
            tool_error(e, "cannot read")
        }),
        (
            "read",
            json!({"target": "/data/../../../../etc/passwd"}),
            |e| tool_error(e, "cannot read"),
        ),
        ("env", json!({"target": "HOME"}), |e| {
            tool_error(e, "no env var")
        }),
        ("env", json!({"target": "PATH"}), |e| {
            tool_error(e, "no env var")
        }),
        // Loopback is granted; other addresses are not (127.0.0.2 would reach this host too).
        ("connect", json!({"target": "127.0.0.2:9"}), |e| {
            tool_error(e, "cannot connect")
        }),
        ("connect", json!({"target": "10.255.255.1:80"}), |e| {
            tool_error(e, "cannot connect")
        }),
        ("flood", json!({"n": 100_000_000}), |e| {
            tool_error(e, "stdout") || matches!(e, PluginError::Trap { .. })
        }),
        ("huge", json!({"n": 1_000_000}), |e| {
            matches!(e, PluginError::Output { .. })
        }),
        (
            "garbage",
            json!({}),
            |e| matches!(e, PluginError::Output { msg, .. } if msg.contains("not JSON")),
        ),
        (
            "bad_utf8",
            json!({}),
            |e| matches!(e, PluginError::Output { msg, .. } if msg.contains("UTF-8")),
        ),
        // The tool's own error is held to the output cap too (cut on a character boundary).
        (
            "error_flood",
            json!({"n": 4_000_000}),
            |e| matches!(e, PluginError::Tool(m) if m.len() <= 64 << 10 && m.contains("4000000 bytes in all")),
        ),
        // Every open file is a resource-table entry, and those are capped per call.
        (
            "fd_hoard",
            json!({"target": "/data/inside.txt", "n": 100_000}),
            |e| matches!(e, PluginError::ResourceLimit { limit: 256, .. }),
        ),
    ];
    for (f, args, expected) in cases {
        let t = Instant::now();
        let err = p.call(f, &args).unwrap_err();
        eprintln!("{f} {args}: {err} [{}] ({:?})", err.kind(), t.elapsed());
        assert!(expected(&err), "{f} {args}: unexpected error {err:?}");
        // Stopped at its deadline, not when it would have ended (a 10-minute sleep, a spin forever).
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{f} took {:?}",
            t.elapsed()
        );
        still_serves(&p);
    }
    drop(listener);

    // Fuel makes a runaway guest stop deterministically, long before its deadline.
    let metered = host()
        .load_with(
            p.path(),
            Grant {
                limits: Limits {
                    fuel: Some(50_000_000),
                    ..p.grant().limits.clone()
                },
                ..p.grant().clone()
            },
        )
        .unwrap();
    let err = metered.call("spin", &json!({})).unwrap_err();
    assert!(matches!(err, PluginError::Fuel { .. }), "{err}");
    let (out, report) = metered.call_reported(&Caller::default(), "ok", &json!({"n": 1}));
    assert_eq!(out.unwrap(), json!(2));
    assert!(
        report.fuel.is_some_and(|f| f > 0 && f < 50_000_000),
        "{report:?}"
    );

    // Synchronous calls work from inside an async runtime too (the server's case).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let inside = rt.block_on(async { metered.call("ok", &json!({"n": 2})) });
    assert_eq!(inside.unwrap(), json!(3));
    let caller = Caller {
        conversation: Some("c".into()),
        ..Caller::default()
    };
    let awaited = rt.block_on(metered.call_async(&caller, "ok", &json!({"n": 3})));
    assert_eq!(awaited.0.unwrap(), json!(4));
}

/// The hostile plugin with a network grant of `hosts` (any port) and nothing else.
fn with_network(hosts: &[(&str, &str)]) -> Plugin {
    let grant = Grant {
        network: hosts
            .iter()
            .map(|(h, a)| NetRule {
                host: (*h).into(),
                port: None,
                addrs: a.parse().into_iter().collect(),
            })
            .collect(),
        ..Grant::none(Limits::default())
    };
    host().load_with(&plugin_wasm("hostile"), grant).unwrap()
}

#[test]
fn guests_look_up_only_the_names_they_were_granted() {
    // A host-name grant turns lookups on, but only for that name: `localhost` would resolve (it is in
    // /etc/hosts) and is refused before any resolver sees it.
    let p = with_network(&[("granted.invalid", ""), ("127.0.0.1", "127.0.0.1")]);
    let err = p
        .call("lookup", &json!({"target": "localhost"}))
        .unwrap_err();
    assert!(tool_error(&err, "cannot resolve localhost"), "{err}");
    let err = p
        .call("lookup", &json!({"target": "secret.exfil.example"}))
        .unwrap_err();
    assert!(tool_error(&err, "cannot resolve"), "{err}");
    // Literals need no resolver.
    assert_eq!(
        p.call("lookup", &json!({"target": "127.0.0.1"})).unwrap(),
        json!(["127.0.0.1"])
    );
    // The granted name itself resolves.
    let p = with_network(&[("localhost", "127.0.0.1")]);
    let addrs = p.call("lookup", &json!({"target": "localhost"})).unwrap();
    assert!(
        addrs
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "127.0.0.1" || a == "::1"),
        "{addrs}"
    );
    still_serves(&p);
}

#[test]
fn read_write_grants_cannot_plant_symlinks() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("inside.txt"), "granted").unwrap();
    std::fs::write(root.path().join("outside.txt"), "not granted").unwrap();
    let grant = Grant {
        preopens: vec![Preopen {
            host: data.clone(),
            guest: "/data".into(),
            write: true,
        }],
        ..Grant::none(Limits::default())
    };
    let p = host().load_with(&plugin_wasm("hostile"), grant).unwrap();
    for target in [
        "/data/out=../outside.txt",
        "/data/in=inside.txt",
        "/data/abs=/etc/passwd",
    ] {
        let err = p.call("symlink", &json!({"target": target})).unwrap_err();
        assert!(tool_error(&err, "not permitted"), "{target}: {err}");
    }
    let names: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, ["inside.txt"]);
    assert_eq!(
        p.call("read", &json!({"target": "/data/inside.txt"}))
            .unwrap(),
        "granted"
    );
}

#[test]
fn sockets_count_against_the_resource_cap() {
    // A listener that accepts (and keeps) every connection, so none waits in a backlog.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acceptor = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            while let Ok((s, _)) = listener.accept() {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                kept.push(s);
            }
        })
    };
    let data = tempfile::tempdir().unwrap();
    let p = hostile(data.path());
    let err = p
        .call(
            "socket_hoard",
            &json!({"target": addr.to_string(), "n": 100_000}),
        )
        .unwrap_err();
    assert!(
        matches!(err, PluginError::ResourceLimit { limit: 256, .. }),
        "{err}"
    );
    still_serves(&p);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(std::net::TcpStream::connect(addr));
    acceptor.join().unwrap();
}
