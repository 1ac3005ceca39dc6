//! Deadman stops with the robot arm's jog (a motion that lasts as long as its call): the host calls
//! `arm_stop` when the motion runs past the operator's deadman, when the call times out, when the
//! e-stop latches and when the call is abandoned; and on the real server when the client goes away
//! mid-jog. The simulator's state file shows each stop: the stop counted, the jog cut short, the joint
//! frozen part of the way.

use super::approvals::keep_alive_request;
use super::safety::install_arm_with;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thorn_plugin::{Caller, Controls, HostConfig, PluginHost, PluginSet, Policy};

/// The arm's state file (`{}` before the arm first moved).
fn arm(dir: &Path) -> Value {
    match std::fs::read_to_string(dir.join("arm/arm.json")) {
        Ok(text) => serde_json::from_str(&text).unwrap(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => json!({}),
        Err(e) => panic!("{e}"),
    }
}

/// The arm installed under `entry`, loaded with its own controls.
fn load(dir: &Path, entry: Value) -> (PluginSet, Controls) {
    let (plugins, policy) = install_arm_with(dir, entry);
    let controls = Controls::default();
    let host = PluginHost::with_config(HostConfig::default())
        .unwrap()
        .with_controls(&controls);
    let policy = Policy::load(Path::new(&policy)).unwrap();
    let set = PluginSet::load_dir(&host, Path::new(&plugins), &policy).unwrap();
    assert!(set.refused().is_empty(), "{:?}", set.refused());
    (set, controls)
}

fn jog(ms: u64) -> Value {
    json!({"joint": "base", "velocity": 20, "duration_ms": ms})
}

/// Waits (generously) until a jog is moving the arm; returns its motion record.
fn until_moving(dir: &Path) -> Value {
    let t0 = Instant::now();
    loop {
        let m = arm(dir)["motion"].clone();
        if !m.is_null() {
            return m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the jog did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (generously) for the state file to show `stops` stops.
fn until_stopped(dir: &Path, stops: u64) -> Value {
    let t0 = Instant::now();
    loop {
        let s = arm(dir);
        if s["stops"] == stops {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "not stopped: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The jog was cut short: stopped, counted as interrupted, the base part of the way to where a 5 s jog
/// at 20 degrees per second would have taken it.
fn cut_short(s: &Value, stops: u64) {
    assert_eq!(s["stops"], stops, "{s}");
    assert_eq!(s["interrupted"], stops, "{s}");
    assert!(s["motion"].is_null(), "{s}");
    let base = s["joints"][0].as_f64().unwrap();
    assert!(base > 0.0 && base < 100.0, "{s}");
}

#[test]
fn a_jog_is_stopped_past_its_deadman_on_timeout_on_estop_and_when_abandoned() {
    let dir = tempfile::tempdir().unwrap();
    let (set, controls) = load(
        dir.path(),
        json!({"functions": {"arm_jog": {"deadman_ms": 1500}}, "limits": {"timeout_ms": 20000}}),
    );
    let caller = Caller::default();
    // A full jog, well within the deadman: it runs its time and nothing stops it.
    let (out, _) = set.call(&caller, "arm_jog", &jog(100));
    let done = out.unwrap();
    assert_eq!(
        (done["base"].as_f64(), done["moving"].as_bool()),
        (Some(2.0), Some(false))
    );
    assert_eq!(arm(dir.path())["stops"], 0);
    // Past the operator's 1.5 s deadman: ended and stopped.
    let t0 = Instant::now();
    let (out, _) = set.call(&caller, "arm_jog", &jog(5000));
    assert!(
        t0.elapsed() < Duration::from_millis(4500),
        "{:?}",
        t0.elapsed()
    );
    let e = out.unwrap_err();
    assert_eq!(e.kind(), "deadman", "{e}");
    cut_short(&arm(dir.path()), 1);
    // The audit log shows the stop, made by the deadman.
    let log = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    assert!(
        log.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .any(|l| l["function"] == "arm_stop" && l["peer"] == "deadman" && l["outcome"] == "ok"),
        "{log}"
    );

    // The e-stop latching mid-jog: interrupted, and the stop runs although it is latched.
    let latch = {
        let estop = Arc::clone(&controls.estop);
        let d = dir.path().to_owned();
        std::thread::spawn(move || {
            until_moving(&d);
            estop.set(true, "test").unwrap();
        })
    };
    let (out, _) = set.call(&caller, "arm_jog", &jog(5000));
    latch.join().unwrap();
    assert_eq!(out.unwrap_err().kind(), "estopped");
    cut_short(&arm(dir.path()), 2);
    controls.estop.set(false, "test").unwrap();

    // Abandoned mid-jog (its request went away): the stop runs on its own.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let args = jog(5000);
    rt.block_on(async {
        let call = set.call_async(&caller, "arm_jog", &args);
        // Dropped once the arm is moving.
        let moving = async {
            while arm(dir.path())["motion"].is_null() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::select! {
            _ = call => panic!("the jog ended by itself"),
            () = moving => {}
        }
    });
    cut_short(&until_stopped(dir.path(), 3), 3);
    let log = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    assert!(log.contains("\"error_kind\":\"cancelled\""), "{log}");
}

#[test]
fn a_jog_that_times_out_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let (set, _controls) = load(dir.path(), json!({"limits": {"timeout_ms": 1500}}));
    let (out, _) = set.call(&Caller::default(), "arm_jog", &jog(5000));
    assert_eq!(out.unwrap_err().kind(), "timeout");
    cut_short(&arm(dir.path()), 1);
}

/// On the server: a client that goes away mid-jog cancels its request, and the host stops the arm.
#[test]
fn a_jog_is_stopped_when_its_client_disconnects() {
    let dir = tempfile::tempdir().unwrap();
    let (plugins, policy) = install_arm_with(dir.path(), json!({"limits": {"timeout_ms": 20000}}));
    let server = thorn_tests::ServeProcess::start(&[
        "--context",
        "2048",
        "--plugins",
        &plugins,
        "--policy",
        &policy,
        "--estop-file",
        &dir.path().join("estop.json").display().to_string(),
    ]);
    let body = json!({"messages": [{"role": "user", "content": "Jog the base at 5 degrees per second for 10 seconds."}],
        "tools": [{"type": "function", "function": {"name": "thorn:arm_jog"}}],
        "tool_choice": "required", "temperature": 0, "max_tokens": 64, "stream": true});
    let mut s = keep_alive_request(server.addr, "", &body);
    // Read until the jog is running (its call announced and the state file says it moves).
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("thorn_host_tool_call") {
        use std::io::Read;
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    let started = until_moving(dir.path());
    drop(s);
    let stopped = until_stopped(dir.path(), 1);
    assert_eq!(stopped["interrupted"], 1, "{stopped}");
    assert!(stopped["motion"].is_null(), "{stopped}");
    let base = stopped["joints"][0].as_f64().unwrap();
    let target = started["from"].as_f64().unwrap() + 5.0 * 10.0;
    assert!(base < target, "stopped short of {target}: {stopped}");
}

/// A stop never waits behind the motion it stops: with one call at a time allowed, `arm_stop` from
/// another caller runs while a jog holds that slot, and cuts the jog short.
#[test]
fn a_stop_does_not_wait_for_the_motions_slot() {
    let dir = tempfile::tempdir().unwrap();
    let (set, _controls) = load(
        dir.path(),
        json!({"limits": {"timeout_ms": 20000, "max_concurrent": 1}}),
    );
    let set = Arc::new(set);
    let jogging = {
        let set = Arc::clone(&set);
        std::thread::spawn(move || set.call(&Caller::default(), "arm_jog", &jog(5000)).0)
    };
    until_moving(dir.path());
    let stopped = set
        .call(&Caller::default(), "arm_stop", &json!({}))
        .0
        .unwrap();
    assert!(!jogging.is_finished(), "the stop waited for the jog");
    assert_eq!(
        (stopped["moving"].as_bool(), stopped["interrupted"].as_u64()),
        (Some(false), Some(1))
    );
    let after = jogging.join().unwrap().unwrap();
    assert!(
        after["base"].as_f64().unwrap() < 100.0,
        "the jog went on: {after}"
    );
    assert!(
        after["motion_seconds"].as_f64().unwrap() < 5.0,
        "it says how long it moved: {after}"
    );
}
