//! The streaming splitter: a round's generated text split into reasoning, answer text and tool-call
//! deltas as it streams, and the record of the calls streamed that the validated reply is checked against.

use thorn_tools::chat::ToolCall;
use thorn_tools::format::harmony::{HarmonyStreamer, Part};
use thorn_tools::{CallDelta, FormatStreamer, ReasoningTags, ToolSet, tag_prefix_len};

use super::StreamedCalls;

/// The part of a generation that answers (calls included): after the reasoning, if the model reasoned
/// (`opened`: the prompt opened the reasoning block itself), as the format's `tags` mark it.
pub(super) fn answer_part(text: &str, opened: bool, tags: ReasoningTags) -> &str {
    let starts = opened || text.trim_start().starts_with(tags.open);
    if !starts {
        return text;
    }
    match text.find(tags.close) {
        Some(i) => text[i + tags.close.len()..].trim_start(),
        None => "",
    }
}

/// Whether the [`Splitter`] is in a reasoning block.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) enum Think {
    /// At the start: the output may open one.
    #[default]
    Maybe,
    /// Inside one.
    Inside,
    /// Past it, or there was none.
    Off,
}

/// What the [`Splitter`] makes of generated text.
pub(super) enum Split {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A streamed tool call's progress.
    Call(CallDelta),
}

/// Splits streamed text into answer text and tool calls: text that might be the start of the tool-call
/// format's trigger (`<tool_call>`) is held back until it is known not to be; everything from the trigger
/// on is not content but goes to the format's streamer ([`FormatStreamer`]), which turns it into call
/// deltas.
#[derive(Debug)]
pub(super) struct Splitter {
    held: String,
    in_calls: bool,
    calls: FormatStreamer,
    /// The format's trigger.
    open: &'static str,
    think: Think,
    /// Where the format's reasoning starts and ends.
    tags: ReasoningTags,
    /// Reasoning (or the output's start) held back: it may be the start of a tag.
    think_held: String,
    /// A format whose output is messages on channels (harmony) has its own lexer for all of it.
    channels: Option<HarmonyStreamer>,
}

impl Splitter {
    /// A splitter for a round whose prompt already opened the reasoning block (`opened`), of calls to
    /// `tools` in their format.
    pub(super) fn new(opened: bool, tools: &ToolSet) -> Self {
        Splitter {
            held: String::new(),
            in_calls: false,
            calls: tools.streamer(),
            open: tools.format().trigger(),
            think: if opened { Think::Inside } else { Think::Maybe },
            tags: tools.format().reasoning(),
            think_held: String::new(),
            channels: tools.format().has_channels().then(HarmonyStreamer::new),
        }
    }

    pub(super) fn push(&mut self, text: &str, active: bool, out: &mut dyn FnMut(Split)) {
        if let Some(ch) = &mut self.channels {
            ch.push(text, &mut |p| channel_part(p, active, out));
            return;
        }
        if self.think != Think::Off {
            let Some(rest) = self.reason(text, out) else {
                return;
            };
            if !rest.is_empty() {
                self.answer(&rest, active, out);
            }
            return;
        }
        self.answer(text, active, out);
    }

    /// Takes a reasoning block off the front of the output: `None` while inside it (or still unsure
    /// whether one starts), else the answer text after it.
    fn reason(&mut self, text: &str, out: &mut dyn FnMut(Split)) -> Option<String> {
        self.think_held.push_str(text);
        if self.think == Think::Maybe {
            let t = self.think_held.trim_start();
            if let Some(after) = t.strip_prefix(self.tags.open) {
                self.think_held = after.to_owned();
                self.think = Think::Inside;
            } else if self.tags.open.starts_with(t) {
                return None;
            } else {
                self.think = Think::Off;
                return Some(std::mem::take(&mut self.think_held));
            }
        }
        if let Some(i) = self.think_held.find(self.tags.close) {
            let reasoning = self.think_held[..i].to_owned();
            let rest = self.think_held[i + self.tags.close.len()..]
                .trim_start()
                .to_owned();
            self.think_held.clear();
            self.think = Think::Off;
            if !reasoning.is_empty() {
                out(Split::Reasoning(reasoning));
            }
            return Some(rest);
        }
        let cut = self.think_held.len() - tag_prefix_len(&self.think_held, self.tags.close);
        if cut > 0 {
            let r: String = self.think_held.drain(..cut).collect();
            out(Split::Reasoning(r));
        }
        None
    }

    fn answer(&mut self, text: &str, active: bool, out: &mut dyn FnMut(Split)) {
        if !active {
            out(Split::Content(text.to_owned()));
            return;
        }
        if self.in_calls {
            self.calls.push(text, &mut |d| out(Split::Call(d)));
            return;
        }
        self.held.push_str(text);
        if let Some(i) = self.held.find(self.open) {
            let before = self.held[..i].to_owned();
            self.in_calls = true;
            let calls = self.held.split_off(i);
            self.held.clear();
            if !before.is_empty() {
                out(Split::Content(before));
            }
            self.calls.push(&calls, &mut |d| out(Split::Call(d)));
            return;
        }
        // Keep the longest suffix that is a prefix of the trigger.
        let cut = self.held.len() - tag_prefix_len(&self.held, self.open);
        if cut > 0 {
            let emit: String = self.held.drain(..cut).collect();
            out(Split::Content(emit));
        }
    }

    pub(super) fn finish(&mut self, out: &mut dyn FnMut(Split)) {
        if let Some(ch) = &mut self.channels {
            // Whether calls were possible no longer matters: a cut-short call is not streamed on.
            ch.finish(&mut |p| channel_part(p, true, out));
            return;
        }
        match self.think {
            // Output shorter than the tag: it was answer text.
            Think::Maybe if !self.think_held.is_empty() => {
                out(Split::Content(std::mem::take(&mut self.think_held)))
            }
            // Reasoning cut off (max_tokens): what there is of it.
            Think::Inside if !self.think_held.is_empty() => {
                out(Split::Reasoning(std::mem::take(&mut self.think_held)))
            }
            _ => {}
        }
        if !self.in_calls && !self.held.is_empty() {
            out(Split::Content(std::mem::take(&mut self.held)));
        }
        // Ready for more text (its calls numbered on).
        self.held.clear();
        self.in_calls = false;
        self.think = Think::Maybe;
        self.think_held.clear();
    }
}

/// A channel lexer's part as the splitter's (a call when calls are not possible is dropped: no guide made
/// it and no reply will carry it).
fn channel_part(p: Part, calls: bool, out: &mut dyn FnMut(Split)) {
    match p {
        Part::Reasoning(r) => out(Split::Reasoning(r)),
        Part::Content(c) => out(Split::Content(c)),
        Part::Call(d) if calls => out(Split::Call(d)),
        Part::Call(_) => {}
    }
}

/// A call one round streamed.
#[derive(Debug, Clone)]
pub(super) struct Streamed {
    /// The id it was streamed with.
    pub(super) id: String,
    /// The tool's name.
    pub(super) name: String,
    /// Whether thorn runs it.
    pub(super) host: bool,
    /// Its index among the request's calls of its kind.
    pub(super) index: usize,
    /// The arguments text streamed so far.
    pub(super) args: String,
}

/// The calls one round streamed.
#[derive(Debug, Default)]
pub(super) struct RoundCalls {
    pub(super) calls: Vec<Streamed>,
}

impl RoundCalls {
    /// Checks the round's validated calls against what was streamed and gives them the streamed ids.
    /// `truncated`: generation stopped at `max_tokens`, so the last streamed call may be cut off.
    pub(super) fn settle(&self, calls: &mut [ToolCall], truncated: bool) -> StreamedCalls {
        let streamed = &self.calls;
        if streamed.len() < calls.len() || (streamed.len() > calls.len() + usize::from(truncated)) {
            return StreamedCalls::Mismatch(format!(
                "{} calls streamed, {} returned",
                streamed.len(),
                calls.len()
            ));
        }
        for (c, s) in calls.iter_mut().zip(streamed) {
            let want = c.function.arguments.to_string();
            if c.function.name != s.name || want != s.args {
                return StreamedCalls::Mismatch(format!(
                    "streamed {}({}), returned {}({want})",
                    s.name, s.args, c.function.name
                ));
            }
            c.id.clone_from(&s.id);
        }
        if streamed.len() > calls.len() {
            StreamedCalls::Truncated
        } else {
            StreamedCalls::Exact
        }
    }
}

/// The request's streamed calls so far, client and host each counted from 0.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) client: usize,
    pub(super) host: usize,
}

impl Counters {
    /// The next index for a call of this kind.
    pub(super) fn next(&mut self, host: bool) -> usize {
        let c = if host {
            &mut self.host
        } else {
            &mut self.client
        };
        *c += 1;
        *c - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const THINK: ReasoningTags = thorn_tools::ToolFormat::Hermes.reasoning();

    fn split(pieces: &[&str]) -> (String, bool) {
        let (content, calls) = split_all(pieces);
        (
            content,
            !calls.is_empty() || pieces.concat().contains(thorn_tools::OPEN),
        )
    }

    /// Content, and the calls' deltas, of streamed pieces.
    fn split_all(pieces: &[&str]) -> (String, Vec<CallDelta>) {
        let mut s = Splitter::new(false, &ToolSet::default());
        let (mut got, mut calls) = (String::new(), Vec::new());
        let mut take = |p: Split| match p {
            Split::Content(t) => got.push_str(&t),
            Split::Reasoning(_) => panic!("no reasoning here"),
            Split::Call(d) => calls.push(d),
        };
        for p in pieces {
            s.push(p, true, &mut take);
        }
        s.finish(&mut take);
        (got, calls)
    }

    /// Content, reasoning and call deltas of streamed pieces, for a prompt that did or did not open the
    /// reasoning block.
    fn split_thinking(opened: bool, pieces: &[&str]) -> (String, String, usize) {
        split_in(opened, &ToolSet::default(), pieces, true)
    }

    /// The answer, the reasoning and the calls begun of `pieces`, split for `tools` (calls possible:
    /// `active`).
    fn split_in(
        opened: bool,
        tools: &ToolSet,
        pieces: &[&str],
        active: bool,
    ) -> (String, String, usize) {
        let mut s = Splitter::new(opened, tools);
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), 0);
        let mut take = |p: Split| match p {
            Split::Content(t) => content.push_str(&t),
            Split::Reasoning(t) => reasoning.push_str(&t),
            Split::Call(CallDelta::Begin { .. }) => calls += 1,
            Split::Call(_) => {}
        };
        for p in pieces {
            s.push(p, active, &mut take);
        }
        s.finish(&mut take);
        (content, reasoning, calls)
    }

    #[test]
    fn splitter_takes_the_reasoning_off_the_front() {
        // Opened by the model, split anywhere, then a call.
        assert_eq!(
            split_thinking(
                false,
                &[
                    "\n<thi",
                    "nk>Let me <tool_call> think.</th",
                    "ink>\n\nSure. <tool_call>{\"name\":\"f\"}"
                ]
            ),
            ("Sure. ".into(), "Let me <tool_call> think.".into(), 1)
        );
        // Opened by the prompt.
        assert_eq!(
            split_thinking(true, &["Hm.", "</think>", "Hi"]),
            ("Hi".into(), "Hm.".into(), 0)
        );
        // No reasoning: a `<` at the start is text; so is a short answer.
        assert_eq!(
            split_thinking(false, &["<", "b>"]),
            ("<b>".into(), String::new(), 0)
        );
        assert_eq!(
            split_thinking(false, &["<t"]),
            ("<t".into(), String::new(), 0)
        );
        // Cut off inside the reasoning: it is all reasoning.
        assert_eq!(
            split_thinking(false, &["<think>still going</"]),
            (String::new(), "still going</".into(), 0)
        );
        // The reply's calls are read after the reasoning only.
        assert_eq!(
            answer_part("<think>a <tool_call></think> b", false, THINK),
            "b"
        );
        assert_eq!(answer_part("x</think>y", true, THINK), "y");
        assert_eq!(answer_part("<think>unfinished", false, THINK), "");
        assert_eq!(
            answer_part("plain </think> text", false, THINK),
            "plain </think> text"
        );
    }

    #[test]
    fn a_harmony_splitter_reads_channels_and_drops_calls_it_cannot_make() {
        let tools = ToolSet::default()
            .with_format(thorn_tools::ToolFormat::Harmony)
            .unwrap();
        let pieces = [
            "<|channel|>analysis<|mess",
            "age|>Think <b>.<|end|><|start|>assistant<|channel|>final<|message|>Hi",
            " there.<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}",
        ];
        let run = |active: bool| split_in(false, &tools, &pieces, active);
        assert_eq!(run(true), ("Hi there.".into(), "Think <b>.".into(), 1));
        assert_eq!(run(false).2, 0, "no calls where none can be made");
    }

    #[test]
    fn splitter_streams_the_calls_it_holds_back() {
        let (content, calls) = split_all(&[
            "Sure. <tool",
            "_call>{\"name\":\"add\",\"argu",
            "ments\":{\"a\":1,",
            "\"b\":2}}</tool_call><tool_call>{\"name\":\"neg\",\"arguments\":{\"x\":3}}</tool_call>",
        ]);
        assert_eq!(content, "Sure. ");
        let text = |i: usize| -> String {
            calls
                .iter()
                .filter_map(|d| match d {
                    CallDelta::Arguments { index, text } if *index == i => Some(text.as_str()),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(
            calls[0],
            CallDelta::Begin {
                index: 0,
                name: "add".into()
            }
        );
        assert_eq!(text(0), "{\"a\":1,\"b\":2}");
        assert_eq!(text(1), "{\"x\":3}");
        // The first call's arguments arrived in a fragment per key and value (`{"a"`, `:1`, `,` at the
        // end of its piece, `"b"`, `:2`, `}`).
        let pieces = calls
            .iter()
            .filter(|d| matches!(d, CallDelta::Arguments { index: 0, .. }))
            .count();
        assert_eq!(pieces, 6);
        assert_eq!(calls.last(), Some(&CallDelta::End { index: 1 }));
    }

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall {
            id: "call_x".into(),
            kind: "function",
            function: thorn_tools::chat::FunctionCall {
                name: name.into(),
                arguments: args,
            },
        }
    }

    #[test]
    fn streamed_calls_settle_against_the_reply() {
        let s = |id: &str, name: &str, host, args: &str| Streamed {
            id: id.into(),
            name: name.into(),
            host,
            index: 0,
            args: args.into(),
        };
        let streamed = RoundCalls {
            calls: vec![
                s("call_a", "f", false, "{\"a\":1}"),
                s("call_b", "g", true, "{\"b\":"),
            ],
        };
        // The truncated second call is not returned; the first gets its streamed id.
        let mut calls = vec![call("f", serde_json::json!({"a": 1}))];
        assert_eq!(streamed.settle(&mut calls, true), StreamedCalls::Truncated);
        assert_eq!(calls[0].id, "call_a");
        // Without truncation the missing call is a mismatch, and so are other arguments.
        assert!(matches!(
            streamed.settle(&mut calls, false),
            StreamedCalls::Mismatch(_)
        ));
        let one = RoundCalls {
            calls: streamed.calls[..1].to_vec(),
        };
        let mut other = vec![call("f", serde_json::json!({"a": 2}))];
        assert!(matches!(
            one.settle(&mut other, false),
            StreamedCalls::Mismatch(_)
        ));
        let mut same = vec![call("f", serde_json::json!({"a": 1}))];
        assert_eq!(one.settle(&mut same, false), StreamedCalls::Exact);
    }

    #[test]
    fn splitter_holds_back_what_may_start_a_call() {
        assert_eq!(
            split(&["Hello ", "wor", "ld"]),
            ("Hello world".into(), false)
        );
        assert_eq!(
            split(&[
                "Let me check. <tool",
                "_call>{\"name\":",
                "\"x\"}</tool_call>"
            ]),
            ("Let me check. ".into(), true)
        );
        // A `<` that turns out not to start the trigger is released.
        assert_eq!(split(&["a <", "b"]), ("a <b".into(), false));
        assert_eq!(split(&["x <tool"]), ("x <tool".into(), false));
        assert_eq!(split(&["<tool_call>{}"]), (String::new(), true));
        assert_eq!(split(&["é<", "tool_call>"]), ("é".into(), true));
    }
}
