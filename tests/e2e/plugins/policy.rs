//! The operator's side of the sandbox: policy pins and grants, the plugin set's routing, the audit log,
//! concurrency limits, the native-code cache, installing over an approved plugin, the e-stop and rate
//! limits.

use super::escapes::hostile;
use super::*;
fn write_policy(dir: &Path, doc: Value) -> Policy {
    let path = dir.join("policy.json");
    std::fs::write(&path, doc.to_string()).unwrap();
    Policy::load(&path).unwrap()
}

#[test]
fn policy_pins_and_grants_decide_what_loads() {
    let dir = tempfile::tempdir().unwrap();
    let calc = host().open(&plugin_wasm("calculator")).unwrap();
    let units = host().open(&plugin_wasm("units")).unwrap();
    // Not in the policy.
    let policy = write_policy(dir.path(), json!({"plugins": {}}));
    let err = host()
        .load(&plugin_wasm("calculator"), &policy)
        .unwrap_err();
    assert!(
        matches!(err, PluginError::Policy(PolicyError::NotApproved { .. })),
        "{err}"
    );
    // Pinned to another binary: refused until re-approved.
    let policy = write_policy(
        dir.path(),
        json!({"plugins": {"units": {"sha256": calc.sha256()}}}),
    );
    let err = host().load(&plugin_wasm("units"), &policy).unwrap_err();
    assert!(
        matches!(&err, PluginError::Policy(PolicyError::Changed { actual, .. }) if actual == units.sha256()),
        "{err}"
    );
    Policy::approve(&dir.path().join("policy.json"), "units", units.sha256()).unwrap();
    let policy = Policy::load(&dir.path().join("policy.json")).unwrap();
    assert!(host().load(&plugin_wasm("units"), &policy).is_ok());
    // Approved but asking for more than is granted: refused, naming each missing grant.
    let hostile = host().open(&plugin_wasm("hostile")).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let policy = write_policy(
        dir.path(),
        json!({"plugins": {"hostile": {"sha256": hostile.sha256(),
            "filesystem": [{"guest": "/data", "host": "data", "access": "read"}]}}}),
    );
    let err = host().load(&plugin_wasm("hostile"), &policy).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("env THORN_TEST_VAR") && msg.contains("network 127.0.0.1:*"),
        "{msg}"
    );
    assert!(!msg.contains("/data"), "{msg}");
    // Fully granted, with limits from the policy.
    let policy = write_policy(
        dir.path(),
        json!({"defaults": {"timeout_ms": 300},
            "plugins": {"hostile": {"sha256": hostile.sha256(),
            "filesystem": [{"guest": "/data", "host": "data", "access": "read"}],
            "env": {"THORN_TEST_VAR": "v"}, "network": ["127.0.0.1:*"],
            "limits": {"memory_mib": 16, "max_concurrent": 3}}}}),
    );
    let p = host().load(&plugin_wasm("hostile"), &policy).unwrap();
    let l = &p.grant().limits;
    assert_eq!(
        (l.timeout, l.memory, l.max_concurrent),
        (Duration::from_millis(300), 16 << 20, 3)
    );
    assert_eq!(
        p.call("env", &json!({"target": "THORN_TEST_VAR"})).unwrap(),
        "v"
    );
    let err = p.call("alloc", &json!({})).unwrap_err();
    assert!(
        matches!(err, PluginError::MemoryLimit { limit, .. } if limit == 16 << 20),
        "{err}"
    );
    // A memory limit above what the host reserves per plugin is refused at load.
    let policy = write_policy(
        dir.path(),
        json!({"plugins": {"calculator": {"sha256": calc.sha256(), "limits": {"memory_mib": 1024}}}}),
    );
    let err = host()
        .load(&plugin_wasm("calculator"), &policy)
        .unwrap_err();
    assert!(err.to_string().contains("per-plugin maximum"), "{err}");
}

#[test]
fn plugin_set_routes_calls_refuses_the_ungranted_and_audits_everything() {
    let dir = tempfile::tempdir().unwrap();
    let installed = dir.path().join("plugins");
    std::fs::create_dir(&installed).unwrap();
    for name in ["calculator", "units", "hostile"] {
        std::fs::copy(plugin_wasm(name), installed.join(format!("{name}.wasm"))).unwrap();
    }
    let sha = |n: &str| host().open(&plugin_wasm(n)).unwrap().sha256().to_owned();
    let policy = write_policy(
        dir.path(),
        json!({"audit": {"path": "logs/audit.jsonl"},
            "plugins": {
                "calculator": {"sha256": sha("calculator"), "audit_arguments": true},
                "units": {"sha256": sha("units")},
                "hostile": {"sha256": sha("hostile")}}}),
    );
    let set = PluginSet::load_dir(host(), &installed, &policy).unwrap();
    let names: Vec<&str> = set.plugins().iter().map(|p| p.name()).collect();
    assert_eq!(names, ["calculator", "units"]);
    assert_eq!(set.refused().len(), 1);
    assert!(
        set.refused()[0]
            .error
            .to_string()
            .contains("does not grant")
    );
    assert!(set.tools().get("evaluate").is_some() && set.tools().get("convert").is_some());
    let conv = |c: &str| Caller {
        conversation: Some(c.into()),
        key_id: Some("key-7".into()),
        peer: Some("192.0.2.1:40000".into()),
        request: None,
    };
    let (ok, _) = set.call(&conv("conv-1"), "evaluate", &json!({"expression": "6*7"}));
    assert_eq!(ok.unwrap(), json!({"value": 42.0}));
    let (err, _) = set.call(&conv("conv-1"), "convert", &json!({"value": "x"}));
    assert!(matches!(err, Err(PluginError::Arguments(_))));
    let (err, _) = set.call(
        &conv("conv-2"),
        "convert",
        &json!({"value": 1, "from": "kg", "to": "m"}),
    );
    assert!(matches!(err, Err(PluginError::Tool(_))));
    let (err, _) = set.call(&Caller::default(), "spin", &json!({}));
    assert!(matches!(err, Err(PluginError::UnknownFunction { .. })));

    let lines = audit_lines(&dir.path().join("logs/audit.jsonl"));
    assert_eq!(lines.len(), 5, "{lines:?}");
    // A call that ran: an intent line (who, what, the arguments when recorded) before it, its outcome after.
    let (intent, done) = (&lines[0], &lines[1]);
    assert_eq!(intent["phase"], "intent");
    assert_eq!(done["phase"], "outcome");
    assert_eq!(intent["call"], done["call"]);
    for l in [intent, done] {
        assert_eq!(l["conversation"], "conv-1");
        assert_eq!(l["key_id"], "key-7");
        assert_eq!(l["peer"], "192.0.2.1:40000");
        assert_eq!(l["plugin"], "calculator");
        assert_eq!(l["function"], "evaluate");
    }
    assert_eq!(intent["args"], json!({"expression": "6*7"}));
    assert!(intent.get("outcome").is_none());
    assert_eq!(done["outcome"], "ok");
    assert!(done.get("args").is_none());
    assert_eq!(intent["args_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(done["result_bytes"], 14);
    // Refused by the schema: one outcome line, nothing ran.
    assert_eq!(lines[2]["phase"], "outcome");
    assert_eq!(lines[2]["outcome"], "rejected");
    assert_eq!(lines[2]["error_kind"], "arguments");
    assert_ne!(lines[2]["call"], done["call"]);
    assert!(
        lines[2].get("args").is_none(),
        "units does not record arguments"
    );
    assert_eq!(lines[3]["phase"], "intent");
    assert_eq!(lines[4]["outcome"], "error");
    assert_eq!(lines[4]["error_kind"], "tool");
    assert_eq!(lines[4]["conversation"], "conv-2");
    assert_eq!(lines[3]["call"], lines[4]["call"]);
    assert!(lines[4]["time"].as_str().unwrap().ends_with('Z'));
}

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn concurrency_is_limited_per_plugin_and_by_the_pool() {
    // A pool of 2 slots with 8 callers: the semaphore in front queues them instead of failing.
    let small = PluginHost::with_config(HostConfig {
        cache_dir: Some(
            std::env::temp_dir().join(format!("thorn-test-cwasm-{}", std::process::id())),
        ),
        pool_slots: 2,
        max_memory: 64 << 20,
    })
    .unwrap();
    let data = tempfile::tempdir().unwrap();
    let mut p = hostile(data.path());
    let limits = Limits {
        timeout: Duration::from_secs(5),
        memory: 32 << 20,
        max_concurrent: 8,
        ..Limits::default()
    };
    p = small
        .load_with(
            p.path(),
            Grant {
                limits: limits.clone(),
                ..p.grant().clone()
            },
        )
        .unwrap();
    let p = Arc::new(p);
    let wave = |p: &Arc<Plugin>, n: usize| {
        let t = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|_| {
                let p = Arc::clone(p);
                std::thread::spawn(move || p.call("sleep", &json!({"n": 100})))
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap().unwrap(), json!(100));
        }
        t.elapsed()
    };
    // 8 sleeps of 100 ms through 2 slots take at least 4 rounds.
    let took = wave(&p, 8);
    assert!(took >= Duration::from_millis(400), "{took:?}");
    // The plugin's own limit applies too: 1 at a time means 4 sleeps take 4 rounds.
    let one = small
        .load_with(
            p.path(),
            Grant {
                limits: Limits {
                    max_concurrent: 1,
                    ..limits
                },
                ..p.grant().clone()
            },
        )
        .unwrap();
    let took = wave(&Arc::new(one), 4);
    assert!(took >= Duration::from_millis(400), "{took:?}");
}

/// A host of its own (no pool: nothing reserved) over `cache`.
fn host_with_cache(cache: &Path) -> PluginHost {
    PluginHost::with_config(HostConfig {
        cache_dir: Some(cache.to_owned()),
        pool_slots: 0,
        max_memory: 256 << 20,
    })
    .unwrap()
}

/// The cached artifact of the component at `wasm` in `cache`.
fn cached(cache: &Path, wasm: &Path) -> std::path::PathBuf {
    let sha = sha256_hex(&std::fs::read(wasm).unwrap());
    let files: Vec<_> = std::fs::read_dir(cache)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&sha))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn cached_native_code_is_tied_to_the_approved_component() {
    let root = tempfile::tempdir().unwrap();
    let cache = root.path().join("cwasm");
    let (calc, units) = (plugin_wasm("calculator"), plugin_wasm("units"));
    let convert = json!({"value": 100, "from": "C", "to": "F"});
    {
        let h = host_with_cache(&cache);
        assert!(h.cache_dir().is_some());
        h.load_with(&calc, Grant::none(Limits::default())).unwrap();
        h.load_with(&units, Grant::none(Limits::default())).unwrap();
    }
    let (calc_file, units_file) = (cached(&cache, &calc), cached(&cache, &units));
    // Another plugin's native code under the approved plugin's name: rejected and recompiled, and the call
    // runs the approved code.
    std::fs::copy(&calc_file, &units_file).unwrap();
    let p = host_with_cache(&cache)
        .load_with(&units, Grant::none(Limits::default()))
        .unwrap();
    assert_eq!(p.manifest().name, "units");
    assert_eq!(p.call("convert", &convert).unwrap()["value"], 212.0);
    assert_ne!(
        std::fs::read(&units_file).unwrap(),
        std::fs::read(&calc_file).unwrap(),
        "the forged file was replaced"
    );
    // One flipped byte: the same.
    let mut bytes = std::fs::read(&units_file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&units_file, &bytes).unwrap();
    let p = host_with_cache(&cache)
        .load_with(&units, Grant::none(Limits::default()))
        .unwrap();
    assert_eq!(p.call("convert", &convert).unwrap()["value"], 212.0);
    assert_ne!(std::fs::read(&units_file).unwrap(), bytes);
    // A cache directory others can write is not trusted: nothing is read from it or written to it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        // Planted: the calculator's code under the units' name (its tag is the victim cache's, which is
        // not this directory's key, but an untrusted directory is not even read).
        let planted = shared.join(units_file.file_name().unwrap());
        std::fs::copy(&calc_file, &planted).unwrap();
        let h = host_with_cache(&shared);
        assert_eq!(h.cache_dir(), None);
        let p = h.load_with(&units, Grant::none(Limits::default())).unwrap();
        assert_eq!(p.call("convert", &convert).unwrap()["value"], 212.0);
        let names: Vec<_> = std::fs::read_dir(&shared).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "nothing written to an untrusted cache");
    }
}

#[test]
fn unpinned_files_are_refused_before_they_are_compiled() {
    let root = tempfile::tempdir().unwrap();
    let installed = root.path().join("plugins");
    std::fs::create_dir(&installed).unwrap();
    for name in ["calculator", "units"] {
        std::fs::copy(plugin_wasm(name), installed.join(format!("{name}.wasm"))).unwrap();
    }
    let calc_sha = sha256_hex(&std::fs::read(plugin_wasm("calculator")).unwrap());
    let units_sha = sha256_hex(&std::fs::read(plugin_wasm("units")).unwrap());
    let policy = write_policy(
        root.path(),
        json!({"plugins": {"calculator": {"sha256": calc_sha}}}),
    );
    let cache = root.path().join("cwasm");
    let set = PluginSet::load_dir(&host_with_cache(&cache), &installed, &policy).unwrap();
    assert_eq!(set.plugins().len(), 1);
    let refused = &set.refused()[0];
    assert!(
        matches!(&refused.error, PluginError::Policy(PolicyError::NotApproved { sha256, .. }) if *sha256 == units_sha),
        "{}",
        refused.error
    );
    // Never compiled: the cache holds the approved plugin's code only.
    let compiled: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cwasm"))
        .collect();
    assert_eq!(compiled.len(), 1, "{compiled:?}");
    assert!(compiled[0].starts_with(&calc_sha));
}

#[test]
fn a_call_that_cannot_be_audited_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(AuditLog::open(&dir.path().join("audit.jsonl")).unwrap());
    let memory = dir.path().join("memory");
    std::fs::create_dir(&memory).unwrap();
    let p = host()
        .load_with(&plugin_wasm("memory"), dir_grant(&memory, "/memory", true))
        .unwrap()
        .with_audit(Arc::clone(&log));
    // The intent record's write fails partway (as on a full disk).
    log.fail_next_write(10);
    let err = p
        .call("remember", &json!({"key": "k", "value": "v"}))
        .unwrap_err();
    assert!(matches!(err, PluginError::Audit(_)), "{err}");
    let written: Vec<_> = std::fs::read_dir(&memory).unwrap().flatten().collect();
    assert!(written.is_empty(), "the plugin ran unaudited: {written:?}");
}

#[test]
fn audit_records_are_bounded_and_keep_arguments_out() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let log_path = root.path().join("audit.jsonl");
    let log = Arc::new(AuditLog::open(&log_path).unwrap());
    let p = hostile(&data).with_audit(Arc::clone(&log));
    // A 4 MB conversation id is refused before anything runs, and not written.
    let huge = Caller {
        conversation: Some("c".repeat(4 << 20)),
        key_id: Some("key-1".into()),
        ..Caller::default()
    };
    let (out, _) = p.call_reported(&huge, "ok", &json!({"n": 1}));
    assert!(matches!(out, Err(PluginError::Caller(_))), "{out:?}");
    // The tool's error quotes its argument; the schema validator quotes the instance.
    let secret = "/data/the-secret-file-name";
    let (out, _) = p.call_reported(&Caller::default(), "read", &json!({"target": secret}));
    assert!(
        matches!(&out, Err(PluginError::Tool(m)) if m.contains(secret)),
        "{out:?}"
    );
    let (out, _) = p.call_reported(
        &Caller::default(),
        "read",
        &json!({"target": "hunter2-password", "n": "not a number"}),
    );
    assert!(matches!(out, Err(PluginError::Arguments(_))), "{out:?}");
    // A huge error is held to the audit log's own bound as well.
    let (out, _) = p.call_reported(&Caller::default(), "error_flood", &json!({"n": 60_000}));
    assert!(matches!(out, Err(PluginError::Tool(_))), "{out:?}");

    let text = std::fs::read_to_string(&log_path).unwrap();
    assert!(!text.contains("the-secret-file-name"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.lines().all(|l| l.len() < 4096), "a line is too long");
    let lines = audit_lines(&log_path);
    assert_eq!(lines[0]["outcome"], "rejected");
    assert_eq!(lines[0]["error_kind"], "caller");
    assert!(lines[0].get("conversation").is_none());
    assert_eq!(lines[0]["key_id"], "key-1");
    let read = &lines[2];
    assert_eq!(read["error_kind"], "tool");
    assert!(
        read["error"].as_str().unwrap().contains("[redacted]"),
        "{read}"
    );
    assert_eq!(lines[3]["error_kind"], "arguments");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&log_path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

/// `thorn plugins install FILE` without `--approve` never replaces the file of an approved plugin with
/// other bytes (the server would then refuse it, taking the approved tool away): it refuses, naming the
/// command that installs and approves, and the approved file stays as it was.
#[test]
fn installing_over_an_approved_plugin_needs_approval() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    let policy = dir.path().join("policy.json");
    let thorn = |args: &[&str]| {
        std::process::Command::new(thorn_tests::thorn_binary())
            .arg("plugins")
            .args(args)
            .arg("--plugins")
            .arg(&plugins)
            .arg("--policy")
            .arg(&policy)
            .output()
            .unwrap()
    };
    let original = plugin_wasm("calculator");
    let out = thorn(&["install", original.to_str().unwrap(), "--approve"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let installed = plugins.join("calculator.wasm");
    let approved = std::fs::read(&installed).unwrap();
    // The same plugin with other bytes (a custom section appended: still a valid component).
    let mut other = approved.clone();
    other.extend_from_slice(&[0, 4, 3, b'x', b'y', b'z']);
    let other_path = dir.path().join("calculator-2.wasm");
    std::fs::write(&other_path, &other).unwrap();
    let out = thorn(&["install", other_path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused");
    assert!(
        err.contains("--approve") && err.contains("is approved"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&installed).unwrap(),
        approved,
        "the approved file stays"
    );
    // With approval it goes in, pinned.
    let out = thorn(&["install", other_path.to_str().unwrap(), "--approve"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(&installed).unwrap(), other);
    let p = Policy::load(&policy).unwrap();
    assert_eq!(p.pinned("calculator"), Some(sha256_hex(&other).as_str()));
    // The same bytes as approved install without a word (nothing changes).
    let out = thorn(&["install", other_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The e-stop latch at the plugin: latched, a move is refused (`estopped`, before the plugin runs) while
/// reading the arm and its stop run; calls already running (a guest spinning, one sleeping in a host call)
/// end at once when it latches; released, moves run again.
#[test]
fn a_latched_estop_refuses_moves_runs_stops_and_interrupts_running_calls() {
    let dir = tempfile::tempdir().unwrap();
    let estop = Arc::new(thorn_plugin::Estop::load(&dir.path().join("estop.json")));
    let host = PluginHost::with_config(HostConfig {
        cache_dir: None,
        pool_slots: 8,
        max_memory: 256 << 20,
    })
    .unwrap()
    .with_estop(Arc::clone(&estop));
    let arm = host
        .load_with(
            &plugin_wasm("robot_arm"),
            dir_grant(dir.path(), "/state", true),
        )
        .unwrap();
    let stop = arm
        .manifest()
        .functions
        .iter()
        .find(|f| f.name == "arm_stop")
        .unwrap();
    assert!(stop.stop, "the SDK's marker reaches the manifest");
    estop.set(true, "test").unwrap();
    let err = arm.call("move_joints", &json!({"base": 10})).unwrap_err();
    assert_eq!(err.kind(), "estopped", "{err}");
    assert_eq!(arm.call("arm_state", &json!({})).unwrap()["base"], 0.0);
    assert_eq!(arm.call("arm_stop", &json!({})).unwrap()["stops"], 1);
    assert!(arm.call("arm_home", &json!({})).is_ok(), "home is a stop");
    estop.set(false, "test").unwrap();
    assert_eq!(
        arm.call("move_joints", &json!({"base": 10})).unwrap()["base"],
        10.0
    );
    // Running calls end when it latches: one spinning in the guest, one asleep in a host call.
    let limits = Limits {
        timeout: Duration::from_secs(60),
        ..Limits::default()
    };
    let hostile = Arc::new(
        host.load_with(&plugin_wasm("hostile"), Grant::none(limits))
            .unwrap(),
    );
    for (function, args) in [("spin", json!({"n": 0})), ("sleep", json!({"n": 60_000}))] {
        let p = Arc::clone(&hostile);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let _ = tx.send((p.call(function, &args), t0.elapsed()));
        });
        std::thread::sleep(Duration::from_millis(300));
        estop.set(true, "test").unwrap();
        let (out, took) = rx.recv_timeout(Duration::from_secs(30)).expect("ended");
        assert_eq!(out.unwrap_err().kind(), "estopped", "{function}");
        assert!(took < Duration::from_secs(30), "{function}: {took:?}");
        estop.set(false, "test").unwrap();
    }
}

/// The policy's rate limits and budgets at the plugin: a key past its calls per minute is refused with
/// `rate_limited` (another key is not), and a joint may not step further than the policy allows from
/// where the last successful move left it; a refused call runs nothing.
#[test]
fn rate_limits_and_steps_from_the_policy_refuse_calls_before_they_run() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        json!({"plugins": {"robot_arm": {
            "sha256": sha256_hex(&std::fs::read(plugin_wasm("robot_arm")).unwrap()),
            "filesystem": [{"guest": "/state", "host": dir.path(), "access": "read-write"}],
            "rates": {"move_joints": {"per_key_per_minute": 3, "max_step": {"base": 15}},
                      "*": {"per_key_per_day": 1}}
        }}}),
    );
    let candidate = host().open(&plugin_wasm("robot_arm")).unwrap();
    let grant = policy
        .grant(candidate.manifest(), candidate.sha256())
        .unwrap();
    assert_eq!(grant.rates["move_joints"].per_key_per_minute, Some(3));
    let arm = host().load_with(&plugin_wasm("robot_arm"), grant).unwrap();
    let as_key = |k: &str| Caller {
        key_id: Some(k.into()),
        ..Caller::default()
    };
    let mv = |k: &str, base: i32| {
        arm.call_reported(&as_key(k), "move_joints", &json!({"base": base}))
            .0
    };
    assert!(mv("robot", 10).is_ok());
    // 30 degrees from 10 is more than a step of 15: refused, and the arm stays at 10.
    let e = mv("robot", 40).unwrap_err();
    assert_eq!(e.kind(), "rate_limited", "{e}");
    assert!(e.to_string().contains("base may move at most 15"), "{e}");
    assert_eq!(arm.call("arm_state", &json!({})).unwrap()["base"], 10.0);
    assert!(mv("robot", 20).is_ok());
    // The key's third call this minute is its last.
    assert!(mv("robot", 25).is_ok());
    let e = mv("robot", 30).unwrap_err();
    assert!(
        e.to_string()
            .contains("at most 3 calls per minute for this key"),
        "{e}"
    );
    assert!(mv("operator", 30).is_ok(), "another key has its own count");
    // Every other function: one call per key per day; but a stop is never held back.
    let state = |k: &str| arm.call_reported(&as_key(k), "arm_state", &json!({})).0;
    assert!(state("robot").is_ok());
    let e = state("robot").unwrap_err();
    assert!(
        e.to_string()
            .contains("budget of 1 calls for the day is spent"),
        "{e}"
    );
    for _ in 0..3 {
        assert!(
            arm.call_reported(&as_key("robot"), "arm_stop", &json!({}))
                .0
                .is_ok()
        );
    }
}
