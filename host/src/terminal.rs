//! `thorn chat` and `thorn run`: the agent with the installed plugins at a terminal, for a conversation
//! or one task; each host call is shown, and a call held for approval is asked about at the terminal.

use crate::serve::{AgentArgs, build_agent};
use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use thorn::agent::{Agent, Event, Turn};
use thorn_engine::sample::SamplingParams;
use thorn_plugin::PluginSet;
use thorn_tools::chat::Message;

/// Every installed plugin's functions as host tools.
fn all_tools(plugins: &PluginSet) -> (Vec<serde_json::Value>, Vec<String>) {
    let defs = plugins.tools().definitions().to_vec();
    let names = plugins
        .tools()
        .tools()
        .iter()
        .map(|t| t.name.clone())
        .collect();
    (defs, names)
}

fn turn(agent: &Agent, messages: Vec<Message>, temperature: f32, seed: Option<u64>) -> Turn {
    let plugins = agent.plugins();
    let (tools, host_tools) = all_tools(&plugins);
    Turn {
        tools,
        host_tools,
        sampling: SamplingParams {
            temperature,
            seed,
            // Small models loop without it, greedy ones most of all.
            repetition_penalty: 1.1,
            ..SamplingParams::default()
        },
        max_tokens: 1024,
        conversation: Some(format!("cli-{}", std::process::id())),
        ..Turn::new(messages, plugins)
    }
}

/// Prints events as they come: text, and each tool call and its result on lines of their own. A call
/// waiting for approval is put to the person at the terminal when stdin is one (they decide as `cli`);
/// otherwise nobody can decide it (`thorn run` and `thorn chat` serve no API) and it is denied when its
/// time runs out.
fn printer(approvals: Option<Arc<thorn_plugin::Approvals>>) -> impl FnMut(Event) + Send {
    use std::io::IsTerminal;
    let ask = std::io::stdin().is_terminal();
    move |e| {
        let mut out = std::io::stdout().lock();
        match e {
            Event::Content(t) => {
                let _ = out.write_all(t.as_bytes());
            }
            // A thinking model's reasoning goes to stderr: stdout is the transcript.
            Event::Reasoning(t) => {
                let _ = std::io::stderr().write_all(t.as_bytes());
            }
            Event::HostCall(c) => {
                let _ = writeln!(
                    out,
                    "\n[tool call] {}({})",
                    c.function.name, c.function.arguments
                );
            }
            Event::HostResult(h) => {
                let _ = match &h.result {
                    Ok(v) => writeln!(out, "[tool result] {v}"),
                    Err(e) => writeln!(out, "[tool error] {e}"),
                };
            }
            Event::ApprovalPending { pending, .. } => {
                let _ = writeln!(
                    out,
                    "[waiting for approval] {}({}) as {}",
                    pending.function, pending.arguments, pending.id
                );
                if let (true, Some(approvals)) = (ask, approvals.clone()) {
                    ask_at_terminal(approvals, pending.id);
                }
            }
            // A call is printed whole when it runs (above), not as it is generated.
            Event::Started { .. } | Event::CallStart { .. } | Event::CallArguments { .. } => {}
        }
        let _ = out.flush();
    }
}

/// Asks the person at the terminal to approve the call waiting as `id` (on a thread of its own: the
/// call waits on the runtime meanwhile).
fn ask_at_terminal(approvals: Arc<thorn_plugin::Approvals>, id: String) {
    let _ = std::thread::Builder::new()
        .name("thorn-approve".into())
        .spawn(move || {
            eprint!("approve it? [y/N] ");
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            let yes = matches!(line.trim(), "y" | "Y" | "yes");
            let by = thorn_plugin::Approver {
                name: "cli".into(),
                key_id: None,
            };
            if let Err(e) = approvals.decide(&id, yes, &by, None) {
                eprintln!("not decided: {e}");
            }
        });
}

/// `thorn run "task"`: one agent run, transcript on stdout.
pub fn run(cache: &Path, a: &AgentArgs, task: &str, system: Option<&str>) -> Result<()> {
    a.place.check()?;
    let agent = build_agent(cache, a, &a.place.controls())?;
    let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
    messages.push(Message::user(task));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!("[user] {task}");
    print!("[assistant] ");
    let out = rt.block_on(agent.run(
        turn(&agent, messages, 0.0, None),
        Arc::new(AtomicBool::new(false)),
        &mut printer(agent.plugins().approvals().cloned()),
    ))?;
    println!();
    for c in &out.tool_calls {
        println!(
            "[client tool call, not run] {}({})",
            c.function.name, c.function.arguments
        );
    }
    eprintln!(
        "[{} round(s), {} prompt tokens ({} cached), {} generated, finish: {}]",
        out.rounds,
        out.usage.prompt_tokens,
        out.usage.cached_tokens,
        out.usage.completion_tokens,
        out.finish.as_str()
    );
    Ok(())
}

/// `thorn chat`: an interactive conversation in the terminal.
/// `thorn chat`: a conversation at the terminal, with line editing and history (kept in
/// `<data dir>/chat_history`). Ctrl-C stops the reply being written (the conversation keeps what was
/// written) or clears the line being typed; Ctrl-D ends the chat.
pub fn chat(cache: &Path, a: &AgentArgs, system: Option<&str>, temperature: f32) -> Result<()> {
    use rustyline::error::ReadlineError;
    a.place.check()?;
    let agent = build_agent(cache, a, &a.place.controls())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
    let mut editor = rustyline::DefaultEditor::new().context("opening the terminal")?;
    let history = thorn::store::data_dir(None).join("chat_history");
    // A first chat has no history yet.
    let _ = editor.load_history(&history);
    eprintln!("type a message and press enter; ctrl-c stops a reply, ctrl-d ends the chat");
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading the terminal"),
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(text);
        messages.push(Message::user(text));
        let cancel = Arc::new(AtomicBool::new(false));
        let mut print = printer(agent.plugins().approvals().cloned());
        let out = rt.block_on(async {
            let run = agent.run(
                turn(&agent, messages.clone(), temperature, None),
                Arc::clone(&cancel),
                &mut print,
            );
            tokio::pin!(run);
            tokio::select! {
                out = &mut run => out,
                _ = tokio::signal::ctrl_c() => {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                    run.await
                }
            }
        })?;
        if out.finish == thorn::agent::Finish::Cancelled {
            print!(" [stopped]");
        }
        println!();
        // Host tool rounds stay inside a turn; the conversation keeps the answer (as far as it went).
        messages.push(Message::assistant(out.content.trim()));
    }
    if let Some(dir) = history.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = editor.save_history(&history) {
        tracing::debug!(error = %e, path = %history.display(), "chat history not saved");
    }
    Ok(())
}
