//! Rounds on the local engine: prompts rendered and tokenized off the engine thread, a generation handed
//! to the engine thread and its text streamed back, the round's calls parsed and settled.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use thorn_engine::engine::scheduler::{Sink, Submission};
use thorn_engine::engine::think::ThinkBudget;
use thorn_engine::engine::{Engine, EngineError, FinishReason, Generation, Request};
use thorn_engine::tokenizer::TokenId;
use thorn_guide::ToolGrammars;
use thorn_tools::chat::Message;
use thorn_tools::{CallDelta, ToolChoice, ToolSet, call_id};
use tokio::sync::mpsc;

use super::split::{Counters, RoundCalls, Split, Splitter, Streamed, answer_part};
use super::{Agent, AgentError, Event, Outcome, RoundCtx, RoundResult, Served, StreamedCalls};
use super::{TokenLogprob, Turn, Usage};

/// What a generation reports to its caller as it goes.
pub(super) enum Piece<'a> {
    Started(usize),
    Text(&'a str),
}

/// What the engine thread reports for one generation.
pub(super) enum Gen {
    Started(usize),
    Text(String),
    Done(Box<Result<(Generation, Vec<TokenLogprob>), AgentError>>),
}

/// Streams a batched sequence's text and result back to the request's task.
pub(super) struct GenSink {
    tx: mpsc::UnboundedSender<Gen>,
    tokenizer: Arc<thorn_engine::tokenizer::Tokenizer>,
    logprobs: bool,
}

impl Sink for GenSink {
    fn text(&mut self, text: &str) {
        let _ = self.tx.send(Gen::Text(text.to_owned()));
    }

    fn done(self: Box<Self>, result: Result<Generation, EngineError>) {
        let out = result.map_err(AgentError::from).map(|generation| {
            let tok = &self.tokenizer;
            let piece = |id| {
                let bytes = tok.token_bytes(id).to_vec();
                (String::from_utf8_lossy(&bytes).into_owned(), bytes)
            };
            let lp = if self.logprobs {
                generation
                    .sampled
                    .iter()
                    .map(|s| {
                        let (token, bytes) = piece(s.token);
                        TokenLogprob {
                            token,
                            bytes,
                            logprob: s.logprob,
                            top: s
                                .top
                                .iter()
                                .map(|&(id, lp)| {
                                    let (t, b) = piece(id);
                                    (t, b, lp)
                                })
                                .collect(),
                        }
                    })
                    .collect()
            } else {
                Vec::new()
            };
            (generation, lp)
        });
        let _ = self.tx.send(Gen::Done(Box::new(out)));
    }
}

/// A prompt to tokenize.
pub(super) enum PromptText {
    /// Rendered from the chat template over quoted data: only the template's markup is control tokens.
    Chat(String),
    /// A raw `/v1/completions` prompt: control-token text is plain text unless the operator opted in.
    Raw(String),
}

impl PromptText {
    fn len(&self) -> usize {
        match self {
            PromptText::Chat(t) | PromptText::Raw(t) => t.len(),
        }
    }
}

impl Agent {
    /// Tokenizes a prompt off the engine thread (and off the async workers), after a byte-length check
    /// that rejects what cannot fit the context without tokenizing it at all.
    pub(super) async fn encode(&self, prompt: PromptText) -> Result<Vec<TokenId>, AgentError> {
        let context = self.model.context;
        let ids = self.tokenize(prompt).await?;
        if ids.len() + 1 > context {
            return Err(AgentError::ContextLength {
                prompt: ids.len(),
                context,
            });
        }
        Ok(ids)
    }

    /// Tokenizes a prompt off the engine thread, after the byte-length check (no context check).
    pub(super) async fn tokenize(&self, prompt: PromptText) -> Result<Vec<TokenId>, AgentError> {
        let context = self.model.context;
        let bytes = prompt.len();
        if bytes > self.model.max_prompt_bytes() {
            return Err(AgentError::PromptBytes { bytes, context });
        }
        let tok = Arc::clone(&self.model.tokenizer);
        let raw_special = self.raw_special;
        let ids = tokio::task::spawn_blocking(move || match &prompt {
            PromptText::Chat(t) => tok.encode_rendered(t),
            PromptText::Raw(t) => tok.encode(t, raw_special),
        })
        .await
        .map_err(|_| AgentError::Lost)?
        .map_err(EngineError::from)?;
        Ok(ids)
    }

    /// The tokens `turn`'s first round would prompt the model with (its conversation and the tools it
    /// shows, rendered by the chat template), whether or not they fit the context.
    pub async fn count_tokens(&self, turn: &Turn) -> Result<usize, AgentError> {
        let all = ToolSet::new(&turn.tools)?.with_format(self.tool_format)?;
        turn.tool_choice.check(&all)?;
        let shown = if turn.tool_choice == ToolChoice::None {
            ToolSet::default()
        } else {
            all
        };
        let text = self.render(&shown, &turn.messages, &self.template_kwargs(turn))?;
        Ok(self.tokenize(PromptText::Chat(text)).await?.len())
    }

    /// The prompt text of `messages` with `shown` tools, from the chat template over quoted data, after
    /// a byte-length check that refuses data the context cannot hold before rendering it.
    pub(super) fn render(
        &self,
        shown: &ToolSet,
        messages: &[Message],
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, AgentError> {
        let template = self.model.template.as_ref().ok_or(AgentError::NoTemplate)?;
        let data: usize = messages.iter().map(Message::data_len).sum();
        if data > self.model.max_prompt_bytes() {
            return Err(AgentError::PromptBytes {
                bytes: data,
                context: self.model.context,
            });
        }
        let tok = &self.model.tokenizer;
        Ok(shown.render_with(
            template,
            messages,
            &self.model.bos,
            &self.model.eos,
            &|s| tok.quote(s),
            Some(kwargs),
        )?)
    }

    /// Runs one generation on the engine thread, streaming its text through `on_text`. A `copying`
    /// generation (a routed call, whose arguments come from the request) is greedy and runs without
    /// repetition penalties: its arguments are read off the request, so sampling only adds errors (`thorn
    /// chat`'s temperature 0.7 turned `17 * 3` into `17 / 3` one time in three), and penalties exist to
    /// stop prose from looping, where here they push the model off the very words it must copy (`17 * 3`
    /// became `24*3` under the CLI's 1.1). The rounds after it sample as the request asks.
    #[expect(clippy::too_many_arguments, reason = "one round's inputs, spelled out")]
    pub(super) async fn generate(
        &self,
        prompt: PromptText,
        tools: Arc<ToolSet>,
        choice: ToolChoice,
        turn: &Turn,
        copying: bool,
        cancel: &Arc<AtomicBool>,
        on: &mut (dyn FnMut(Piece<'_>) + Send),
    ) -> Result<(Generation, Vec<TokenLogprob>), AgentError> {
        // A think block the prompt opened (or the output opens) is closed when the budget is spent.
        let tags = tools.format().reasoning();
        let opened = matches!(&prompt, PromptText::Chat(t) if t.trim_end().ends_with(tags.open));
        let think_budget = match turn.reasoning_budget.or(self.reasoning_budget) {
            Some(tokens) => Some(ThinkBudget {
                tokens,
                opened,
                open: tags.open.into(),
                close: tags.close.into(),
                close_tokens: self
                    .model
                    .tokenizer
                    .encode(tags.closing, true)
                    .map_err(EngineError::from)?,
            }),
            None => None,
        };
        let prompt = self.encode(prompt).await?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Gen>();
        let parallel = turn.parallel_tool_calls;
        let format = turn.response_format.clone();
        let max_tokens = self.output_tokens(turn);
        let mut req = Request {
            max_tokens,
            sampling: turn.sampling.clone(),
            stop: turn.stop.clone(),
            cancel: Some(Arc::clone(cancel)),
            speculate: turn.speculation,
            think_budget,
            shown_controls: thorn_guide::shown_controls(&self.model.tokenizer, tools.format()),
            ..Request::greedy(prompt, max_tokens)
        };
        if copying {
            req.sampling.temperature = 0.0;
            req.sampling.repetition_penalty = 1.0;
            req.sampling.presence_penalty = 0.0;
            req.sampling.frequency_penalty = 0.0;
        }
        let logprobs = turn.logprobs;
        self.engine.generate(Box::new(move |engine: &mut Engine| {
            let prepared = (|| -> Result<Submission, AgentError> {
                let guide = engine
                    .grammars()
                    .map_err(EngineError::from)?
                    .guide(&tools, &choice, parallel, &format)?;
                let _ = tx.send(Gen::Started(req.prompt.len()));
                Ok(Submission {
                    request: std::mem::replace(&mut req, Request::greedy(Vec::new(), 0)),
                    guide: guide.map(Box::new),
                    sink: Box::new(GenSink {
                        tx: tx.clone(),
                        tokenizer: engine.tokenizer_arc(),
                        logprobs,
                    }),
                })
            })();
            match prepared {
                Ok(sub) => Some(sub),
                Err(e) => {
                    let _ = tx.send(Gen::Done(Box::new(Err(e))));
                    None
                }
            }
        }))?;
        while let Some(ev) = rx.recv().await {
            match ev {
                Gen::Started(n) => on(Piece::Started(n)),
                Gen::Text(t) => on(Piece::Text(&t)),
                Gen::Done(out) => return *out,
            }
        }
        Err(AgentError::Lost)
    }

    /// Continues raw `prompt` text (no chat template, no tools; `turn.messages` is ignored).
    pub async fn complete(
        &self,
        prompt: String,
        turn: &Turn,
        cancel: Arc<AtomicBool>,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<Outcome, AgentError> {
        let mut content = String::new();
        let (generation, logprobs) = self
            .generate(
                PromptText::Raw(prompt),
                Arc::new(ToolSet::default()),
                ToolChoice::None,
                turn,
                false,
                &cancel,
                &mut |p| match p {
                    Piece::Started(n) => on_event(Event::Started {
                        prompt_tokens: n,
                        model: self.model.name.clone(),
                    }),
                    Piece::Text(t) => {
                        content.push_str(t);
                        on_event(Event::Content(t.to_owned()));
                    }
                },
            )
            .await?;
        Ok(Outcome {
            content,
            reasoning: String::new(),
            tool_calls: Vec::new(),
            host_calls: Vec::new(),
            finish: generation.finish.into(),
            stop_string: generation.stop_string.clone(),
            usage: Usage {
                prompt_tokens: generation.stats.prompt_tokens,
                cached_tokens: generation.stats.cached_tokens,
                completion_tokens: generation.stats.generated,
            },
            logprobs,
            rounds: 1,
            first_token: generation.stats.first_token,
            streamed: StreamedCalls::Exact,
            routed: None,
            served: Served {
                model: self.model.name.clone(),
                upstream: None,
                spilled: None,
            },
        })
    }
    /// One round on the local engine: the conversation rendered by the chat template, generated on the
    /// engine thread, its text split into answer, reasoning and calls as it streams, the calls parsed
    /// and validated when it ends.
    pub(super) async fn local_round(
        &self,
        r: &RoundCtx<'_>,
        routed: bool,
        counters: &mut Counters,
        on_event: &mut (dyn FnMut(Event) + Send),
    ) -> Result<RoundResult, AgentError> {
        let prompt_text = self.render(r.shown, r.messages, &self.template_kwargs(r.turn))?;
        // A thinking model's template may open the reasoning block in the prompt itself.
        let tags = r.shown.format().reasoning();
        let opened = prompt_text.trim_end().ends_with(tags.open);
        let mut splitter = Splitter::new(opened, r.shown);
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut round_calls = RoundCalls::default();
        let generation = {
            let round = &mut content;
            let round_r = &mut reasoning;
            let streamed = &mut round_calls;
            let host_tools = &r.turn.host_tools;
            let first_round = r.first_round;
            let model = &self.model.name;
            let mut emit = |ev: Event| {
                match &ev {
                    Event::Content(s) => round.push_str(s),
                    Event::Reasoning(s) => round_r.push_str(s),
                    _ => {}
                }
                on_event(ev);
            };
            let mut split = |piece: Split, emit: &mut dyn FnMut(Event)| match piece {
                Split::Content(s) => emit(Event::Content(s)),
                Split::Reasoning(s) => emit(Event::Reasoning(s)),
                Split::Call(CallDelta::Begin { name, .. }) => {
                    let host = host_tools.contains(&name);
                    let index = counters.next(host);
                    let id = call_id();
                    streamed.calls.push(Streamed {
                        id: id.clone(),
                        name: name.clone(),
                        host,
                        index,
                        args: String::new(),
                    });
                    emit(Event::CallStart {
                        host,
                        index,
                        id,
                        name,
                    });
                }
                Split::Call(CallDelta::Arguments { index, text }) => {
                    if let Some(s) = streamed.calls.get_mut(index) {
                        s.args.push_str(&text);
                        emit(Event::CallArguments {
                            host: s.host,
                            index: s.index,
                            text,
                        });
                    }
                }
                Split::Call(CallDelta::End { .. }) => {}
            };
            let calls_possible = r.calls_possible;
            let g = self
                .generate(
                    PromptText::Chat(prompt_text),
                    Arc::clone(r.shown),
                    r.choice.clone(),
                    r.turn,
                    routed,
                    r.cancel,
                    &mut |piece| match piece {
                        Piece::Started(n) if first_round => emit(Event::Started {
                            prompt_tokens: n,
                            model: model.clone(),
                        }),
                        Piece::Started(_) => {}
                        Piece::Text(t) => {
                            splitter.push(t, calls_possible, &mut |p| split(p, &mut emit))
                        }
                    },
                )
                .await;
            splitter.finish(&mut |p| split(p, &mut emit));
            g
        };
        let (generation, logprobs) = generation?;
        let mut res = RoundResult {
            content,
            reasoning,
            calls: Vec::new(),
            rejected: Vec::new(),
            finish: generation.finish.into(),
            stop_string: generation.stop_string.clone(),
            usage: Usage {
                prompt_tokens: generation.stats.prompt_tokens,
                cached_tokens: generation.stats.cached_tokens,
                completion_tokens: generation.stats.generated,
            },
            logprobs,
            first_token: generation.stats.first_token,
            streamed: StreamedCalls::Exact,
        };
        if generation.finish == FinishReason::Cancelled || !r.calls_possible {
            return Ok(res);
        }
        // Calls are read from the answer only, never from the reasoning before it.
        let answer = answer_part(&generation.text, opened, tags);
        let truncated = generation.finish == FinishReason::Length;
        let text = if truncated {
            r.shown.complete_prefix(answer)
        } else {
            answer
        };
        match r.shown.reply(text) {
            Ok(mut reply) => {
                res.streamed = round_calls.settle(&mut reply.calls, truncated);
                res.calls = reply.calls;
            }
            Err(e) => {
                tracing::warn!(error = %e, "unparseable tool calls are returned as text");
                if !round_calls.calls.is_empty() {
                    res.streamed = StreamedCalls::Mismatch(format!(
                        "the streamed tool calls failed validation: {e}"
                    ));
                }
            }
        }
        Ok(res)
    }
}
