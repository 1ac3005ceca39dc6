//! `thorn chat` at a real terminal (tmux): Ctrl-C stops the reply being written and the chat goes on
//! (the next message is answered), the history is kept, and Ctrl-D ends the chat.

use std::process::Command;
use std::time::{Duration, Instant};

/// tmux, or `None` (skipped with a note) where it is not installed and `THORN_REQUIRE_TMUX` is not 1.
fn tmux() -> Option<()> {
    let found = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("THORN_REQUIRE_TMUX").is_none_or(|v| v != "1"),
            "THORN_REQUIRE_TMUX=1 but tmux is not installed"
        );
        eprintln!("skip: the terminal test (tmux is not installed)");
    }
    found.then_some(())
}

struct Session(String);

impl Session {
    fn keys(&self, keys: &[&str]) {
        let ok = Command::new("tmux")
            .args(["send-keys", "-t", &self.0])
            .args(keys)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "tmux send-keys {keys:?}");
    }

    fn screen(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-J", "-S", "-200", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits (at most two minutes: a loaded machine) until `ok` holds for the screen; returns it.
    fn until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "{what}:\n{s}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

#[test]
fn ctrl_c_stops_a_reply_and_the_chat_goes_on_until_ctrl_d() {
    let Some(()) = tmux() else { return };
    let data = tempfile::tempdir().unwrap();
    let name = format!("thorn-chat-{}", std::process::id());
    let command = format!(
        "THORN_DATA_DIR={} {} chat --model {} --threads 1 --speculation off --no-plugins; echo EXITED $?; sleep 600",
        data.path().display(),
        thorn_tests::thorn_binary().display(),
        thorn_tests::default_model().display()
    );
    let ok = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &name,
            "-x",
            "160",
            "-y",
            "50",
            &command,
        ])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "tmux new-session");
    let s = Session(name);
    s.until("the chat's first prompt", |t| {
        t.contains("ctrl-d ends the chat")
    });

    let ask = "Write a very long story about a robot who learns to paint.";
    s.keys(&[ask, "Enter"]);
    // As soon as the reply has begun, Ctrl-C.
    s.until("a reply begins", |t| {
        t.split(ask)
            .nth(1)
            .is_some_and(|after| after.trim().len() > 5)
    });
    s.keys(&["C-c"]);
    let t = s.until("the reply stopped", |t| t.contains("[stopped]"));
    assert_eq!(t.matches("[stopped]").count(), 1, "{t}");

    // The chat goes on: the next message gets an answer and a new prompt.
    s.keys(&["Say hi.", "Enter"]);
    s.until("an answer to the next message", |t| {
        t.split("> Say hi.")
            .nth(1)
            .is_some_and(|after| after.contains("\n> ") || after.trim_end().ends_with('>'))
    });
    s.keys(&["C-d"]);
    s.until("the chat ended", |t| t.contains("EXITED 0"));
    let history = std::fs::read_to_string(data.path().join("chat_history")).unwrap();
    assert!(
        history.contains(ask) && history.contains("Say hi."),
        "{history}"
    );
}
