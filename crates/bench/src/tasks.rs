//! `thorn bench tasks`: does the agent use its tools when it should, and only then?
//!
//! The task set (`data/tasks.jsonl`, built in) has 40 tasks over the five example plugins (calculator,
//! units, files, memory, robot_arm), each naming the host function that answers it, the arguments that
//! function must get (a subset: numbers to 1e-6, strings case-insensitively) and text the final answer must
//! contain (one of the listed spellings); and 10 prompts that need no tool. Every task is one chat request
//! to an endpoint with all five plugins offered as host tools (`thorn:<plugin>`), `tool_choice` as asked
//! (default `auto`), temperature 0. A tool task is right when the expected function was called without
//! error with matching arguments and the answer contains what it should; a no-tool prompt is right when
//! no tool was called. The files tasks read the `README.txt` that `scripts/install-plugins` puts in the
//! workspace; the memory tasks run in order (a recall follows its remember).

use crate::client::{Endpoint, EndpointArgs};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::time::Duration;
use thorn_openai::{AssistantMessage, ChatRequest, HostCall, Message, ToolUseOpts};

/// The built-in task set.
const TASKS: &str = include_str!("../data/tasks.jsonl");
/// The held-out set: other wording of the same kinds of task, written before any design was tuned on
/// [`TASKS`], so a design's figure on it says whether it generalizes.
const HELDOUT: &str = include_str!("../data/tasks-heldout.jsonl");

/// The example plugins the tasks use.
pub const PLUGINS: [&str; 5] = ["calculator", "units", "files", "memory", "robot_arm"];

/// The example plugin that provides `function`.
pub fn plugin_of(function: &str) -> Option<&'static str> {
    Some(match function {
        "evaluate" => "calculator",
        "convert" => "units",
        "list_files" | "read_file" | "search_files" => "files",
        "remember" | "recall" | "forget" | "list_keys" => "memory",
        "move_joints" | "arm_state" | "arm_home" => "robot_arm",
        _ => return None,
    })
}

/// One task.
#[derive(Debug, Clone)]
pub struct Task {
    /// Name.
    pub id: String,
    /// The user's message.
    pub prompt: String,
    /// The host function that answers it (`None`: no tool should be called).
    pub tool: Option<String>,
    /// Arguments the call must have (a subset).
    pub args: Option<Value>,
    /// The answer must contain one of these (empty: no check).
    pub expect: Vec<String>,
}

/// Parses the built-in task set.
pub fn builtin() -> Result<Vec<Task>> {
    parse(TASKS)
}

/// Parses the held-out set.
pub fn heldout() -> Result<Vec<Task>> {
    parse(HELDOUT)
}

/// Parses a task set (JSON lines).
fn parse(text: &str) -> Result<Vec<Task>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let v: Value =
                serde_json::from_str(l).with_context(|| format!("tasks line {}", i + 1))?;
            Ok(Task {
                id: v["id"].as_str().context("a task needs an id")?.to_owned(),
                prompt: v["prompt"]
                    .as_str()
                    .context("a task needs a prompt")?
                    .to_owned(),
                tool: v["tool"].as_str().map(str::to_owned),
                args: v.get("args").cloned(),
                expect: v["expect"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|s| s.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// Whether `got` has every field of `want` (numbers to 1e-6, strings case-insensitively equal).
fn args_match(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => w
            .iter()
            .all(|(k, wv)| g.get(k).is_some_and(|gv| args_match(wv, gv))),
        (Value::Number(w), Value::Number(g)) => {
            (w.as_f64().unwrap_or(f64::NAN) - g.as_f64().unwrap_or(f64::NAN)).abs() < 1e-6
        }
        (Value::String(w), Value::String(g)) => w.eq_ignore_ascii_case(g.trim()),
        (w, g) => w == g,
    }
}

/// What one task's answer was judged to be.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The expected function was called without error (or, for a no-tool prompt, nothing was called).
    pub called: bool,
    /// Its arguments matched.
    pub args: bool,
    /// The answer had what it should.
    pub answer: bool,
}

impl Verdict {
    /// All three.
    pub fn right(&self) -> bool {
        self.called && self.args && self.answer
    }
}

/// Judges a chat completion (thorn's, with `message.thorn_host_tool_calls`) for `task`.
pub fn judge(task: &Task, msg: &AssistantMessage<'_>) -> Verdict {
    let calls = &msg.thorn_host_tool_calls;
    let content = msg.content.as_deref().unwrap_or("").to_lowercase();
    let Some(tool) = &task.tool else {
        let none = calls.is_empty();
        return Verdict {
            called: none,
            args: true,
            answer: true,
        };
    };
    let ok: Vec<&HostCall<'_>> = calls
        .iter()
        .filter(|c| c.name == tool.as_str() && c.error.is_none())
        .collect();
    let args = ok.iter().any(|c| {
        let got: Value = serde_json::from_str(&c.arguments).unwrap_or(Value::Null);
        task.args.as_ref().is_none_or(|w| args_match(w, &got))
    });
    // The answer itself must state the value: a tool result the model then ignores does not count.
    let answer = task.expect.is_empty()
        || task.expect.iter().any(|e| {
            content.contains(&e.to_lowercase())
                || content.replace(',', "").contains(&e.to_lowercase())
        });
    Verdict {
        called: !ok.is_empty(),
        args: !ok.is_empty() && args,
        answer,
    }
}

/// What `thorn bench tasks` runs.
#[derive(clap::Args, Debug, Clone)]
pub struct Opts {
    #[command(flatten)]
    pub endpoint: EndpointArgs,
    /// `tool_choice` for every request.
    #[arg(long, default_value = "auto")]
    pub tool_choice: String,
    /// The design's name in the report.
    #[arg(long, default_value = "default")]
    pub label: String,
    /// Offer each task only its own plugin (no tools for the no-tool prompts): the ceiling of a perfect
    /// tool router, to measure designs against.
    #[arg(long)]
    pub oracle_tools: bool,
    /// `thorn_tool_use` for every request, as JSON (e.g. `{"routing": "off"}`; default: the server's).
    #[arg(long)]
    pub tool_use: Option<String>,
    /// Which task set: `main` (40 tool tasks, 10 plain prompts) or `heldout` (20 and 10, written before
    /// any design was tuned on `main`).
    #[arg(long, default_value = "main")]
    pub set: String,
    /// Measure the "tool-first round with an answer function" design: offer a client tool `answer(text)`
    /// beside the plugins and force a call; a call to it is the answer.
    #[arg(long)]
    pub answer_tool: bool,
}

/// Runs the task set against the endpoint and prints (and writes) the report.
pub fn run(o: &Opts) -> Result<()> {
    let tool_use: Option<ToolUseOpts> = o
        .tool_use
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .context("--tool-use is not thorn_tool_use (routing, examples, answers)")?;
    let ep = Endpoint::new(
        &o.endpoint.url,
        o.endpoint.api_key.clone(),
        Duration::from_secs(600),
    );
    let model = match &o.endpoint.model {
        Some(m) => m.clone(),
        None => ep.model()?,
    };
    let tools: Vec<Value> = PLUGINS
        .iter()
        .map(|p| json!({"type": "function", "function": {"name": format!("thorn:{p}")}}))
        .collect();
    let tasks = match o.set.as_str() {
        "main" => builtin()?,
        "heldout" => heldout()?,
        s => bail!("no task set {s:?} (main, heldout)"),
    };
    let mut rows = Vec::new();
    let (mut tool_right, mut tool_n, mut plain_right, mut plain_n) = (0, 0, 0, 0);
    for t in &tasks {
        let mut body = ChatRequest {
            model: Some(model.as_str().into()),
            messages: vec![Message::text("user", t.prompt.as_str())],
            tools: Some(tools.as_slice().into()),
            tool_choice: Some(o.tool_choice.as_str().into()),
            temperature: Some(0.0),
            max_tokens: Some(o.endpoint.max_tokens_u32()),
            conversation_id: Some("bench-tasks".into()),
            thorn_tool_use: tool_use,
            ..ChatRequest::default()
        };
        if o.answer_tool {
            body.tool_choice = Some("required".into());
            body.parallel_tool_calls = Some(false);
            let answer = json!({"type": "function", "function": {"name": "answer",
                "description": "Answers the user directly, when no other tool is needed.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string",
                    "description": "The answer."}}, "required": ["text"]}}});
            if let Some(list) = &mut body.tools {
                list.to_mut().push(answer);
            }
        }
        if o.oracle_tools {
            match t.tool.as_deref().and_then(plugin_of) {
                Some(p) => {
                    let only =
                        json!({"type": "function", "function": {"name": format!("thorn:{p}")}});
                    body.tools = Some(vec![only].into());
                }
                None => {
                    body.tools = None;
                    body.tool_choice = None;
                }
            }
        }
        let mut v = ep.chat_json(&body).with_context(|| t.id.clone())?;
        let Some(msg) = v.choices.first_mut().map(|c| &mut c.message) else {
            bail!("{}: an answer without choices", t.id);
        };
        if o.answer_tool {
            // The answer function's text is the answer.
            let text = msg
                .tool_calls
                .iter()
                .find(|c| c.function.name == "answer")
                .map(|c| {
                    let args: Value =
                        serde_json::from_str(&c.function.arguments).unwrap_or(Value::Null);
                    args["text"].as_str().unwrap_or("").to_owned()
                });
            if let Some(text) = text {
                let before = msg.content.as_deref().unwrap_or("");
                msg.content = Some(format!("{before}{text}").into());
            }
        }
        let msg = &*msg;
        let verdict = judge(t, msg);
        if t.tool.is_some() {
            tool_n += 1;
            tool_right += usize::from(verdict.right());
        } else {
            plain_n += 1;
            plain_right += usize::from(verdict.right());
        }
        let calls: Vec<Value> = msg
            .thorn_host_tool_calls
            .iter()
            .map(|c| json!([c.name, c.arguments]))
            .collect();
        eprintln!(
            "{:<20} {} {} {}",
            t.id,
            if verdict.right() { "right" } else { "wrong" },
            serde_json::to_string(&calls).unwrap_or_default(),
            serde_json::to_string(&msg.thorn_routed_tools).unwrap_or_default()
        );
        rows.push(
            json!({"id": t.id, "tool": t.tool, "right": verdict.right(), "called": verdict.called,
            "args": verdict.args, "answer": verdict.answer, "calls": calls,
            "routed": msg.thorn_routed_tools, "content": msg.content}),
        );
    }
    let report = json!({"label": o.label, "model": model, "tool_choice": o.tool_choice,
        "tool_use": tool_use, "set": o.set, "answer_tool": o.answer_tool,
        "tool_tasks": tool_n, "tool_right": tool_right, "no_tool_prompts": plain_n,
        "no_tool_right": plain_right, "tasks": rows});
    let pct = |a: usize, n: usize| 100.0 * a as f64 / n.max(1) as f64;
    let md = format!(
        "| design | tool tasks right | no-tool prompts without a call |\n|---|---:|---:|\n| {} (`tool_choice: {}`) | {tool_right}/{tool_n} ({:.0}%) | {plain_right}/{plain_n} ({:.0}%) |\n",
        o.label,
        o.tool_choice,
        pct(tool_right, tool_n),
        pct(plain_right, plain_n)
    );
    println!("{md}");
    if let Some(p) = &o.endpoint.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(p) = &o.endpoint.markdown {
        std::fs::write(p, &md)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_set_has_forty_tool_tasks_and_ten_plain_prompts() {
        let t = builtin().unwrap();
        assert_eq!(t.iter().filter(|t| t.tool.is_some()).count(), 40);
        assert_eq!(t.iter().filter(|t| t.tool.is_none()).count(), 10);
        let mut ids: Vec<&str> = t.iter().map(|t| t.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 50, "ids are unique");
        for task in &t {
            if let Some(f) = &task.tool {
                assert!(plugin_of(f).is_some(), "{f}: no example plugin provides it");
            }
        }
    }

    #[test]
    fn judging_checks_the_call_its_arguments_and_the_answer() {
        let task = Task {
            id: "u".into(),
            prompt: String::new(),
            tool: Some("convert".into()),
            args: Some(json!({"value": 10, "from": "km"})),
            expect: vec!["6.21".into()],
        };
        let reply =
            |name: &str, args: &str, error: Value, content: &str| -> AssistantMessage<'static> {
                serde_json::from_value(json!({"content": content, "thorn_host_tool_calls": [
                {"id": "call_1", "name": name, "arguments": args, "error": error}]}))
                .unwrap()
            };
        let right = reply(
            "convert",
            r#"{"value":10.0,"from":"KM","to":"mi"}"#,
            Value::Null,
            "About 6.21 miles.",
        );
        assert!(judge(&task, &right).right());
        let wrong_args = reply(
            "convert",
            r#"{"value":1,"from":"km","to":"mi"}"#,
            Value::Null,
            "6.21",
        );
        assert_eq!(
            judge(&task, &wrong_args),
            Verdict {
                called: true,
                args: false,
                answer: true
            }
        );
        let failed = reply(
            "convert",
            r#"{"value":10,"from":"km"}"#,
            json!("bad unit"),
            "6.21",
        );
        assert!(!judge(&task, &failed).called);
        let no_answer = reply(
            "convert",
            r#"{"value":10,"from":"km"}"#,
            Value::Null,
            "Done.",
        );
        assert!(!judge(&task, &no_answer).answer);
        let plain = Task {
            tool: None,
            args: None,
            expect: vec![],
            ..task
        };
        assert!(
            judge(
                &plain,
                &serde_json::from_value(json!({"content": "Paris"})).unwrap()
            )
            .right()
        );
        assert!(!judge(&plain, &right).right());
    }
}
