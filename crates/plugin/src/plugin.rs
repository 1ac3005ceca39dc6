//! A loaded plugin and its call path: validation, the audit trail, a slot, then one fresh instance of the
//! component per call (from its pre-linked `InstancePre`), bounded by the grant's limits.

use crate::manifest::Manifest;
use crate::sandbox::{self, Shared, State, ToolPre};
use crate::{AuditLog, Caller, Estop, Grant, PluginError, trail};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thorn_tools::ToolSet;
use tokio::sync::Semaphore;
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

/// A loaded plugin, ready to call. Cheap to share behind an `Arc`; calls may run concurrently.
pub struct Plugin {
    pub(crate) name: String,
    pub(crate) sha256: String,
    pub(crate) path: PathBuf,
    pub(crate) pre: ToolPre<State>,
    pub(crate) grant: Grant,
    pub(crate) manifest: Manifest,
    pub(crate) tools: ToolSet,
    pub(crate) engine: Engine,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) _shared: Arc<Shared>,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) own: Arc<Semaphore>,
    pub(crate) audit: Option<Arc<AuditLog>>,
    /// The process's e-stop latch (the host's).
    pub(crate) estop: Arc<Estop>,
    /// The process's approvals queue (the host's).
    pub(crate) approvals: Arc<crate::Approvals>,
    /// Counts for the grant's rate limits and budgets.
    pub(crate) rate: crate::RateState,
    pub(crate) max_memory: usize,
    /// The granted host names (not addresses): the only names the guest may look up.
    pub(crate) lookup_names: Arc<[String]>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .finish_non_exhaustive()
    }
}

/// What one call produced besides its result.
#[derive(Debug, Clone, Default)]
pub struct CallReport {
    /// Wall time of the call, waiting for a slot included.
    pub duration: Duration,
    /// Fuel used (when metered).
    pub fuel: Option<u64>,
    /// What the guest wrote to stdout and stderr (bounded).
    pub stdout: String,
    /// See `stdout`.
    pub stderr: String,
}

impl Plugin {
    /// The plugin's name (from its manifest).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The component's sha256.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// What it was granted.
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Its functions as tools (for prompts, grammars and validation).
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// Records every call in `log` from now on.
    pub fn with_audit(mut self, log: Arc<AuditLog>) -> Self {
        self.audit = Some(log);
        self
    }

    /// Runs `fut` to completion from synchronous code, on the host's runtime (from a thread of its own
    /// when the caller is itself inside a tokio runtime, where blocking in place is not allowed).
    pub(crate) fn block_on<F: std::future::Future + Send>(&self, fut: F) -> F::Output
    where
        F::Output: Send,
    {
        sandbox::block_on(&self.handle, fut)
    }

    /// Calls `function` with `args` (validated against its schema first), blocking until it ends.
    pub fn call(&self, function: &str, args: &Value) -> Result<Value, PluginError> {
        self.call_reported(&Caller::default(), function, args).0
    }

    /// [`Plugin::call`] for `caller`, with the call's report (time, fuel, captured output) even when it
    /// fails.
    pub fn call_reported(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        self.block_on(self.call_async(caller, function, args))
    }

    /// Instantiates the plugin once under its limits and drops the instance without calling anything:
    /// a health check, and the cost every call pays on top of its own work.
    pub fn ping(&self) -> Result<Duration, PluginError> {
        self.block_on(async {
            let t0 = Instant::now();
            let mut store = self.store()?.0;
            self.pre
                .instantiate_async(&mut store)
                .await
                .map_err(|e| self.classify(e, ""))?;
            Ok(t0.elapsed())
        })
    }

    /// Calls `function` with `args` for `caller`: validation, the intent record, a slot, a fresh instance,
    /// the outcome record ([`trail::audited`]).
    pub async fn call_async(
        &self,
        caller: &Caller,
        function: &str,
        args: &Value,
    ) -> (Result<Value, PluginError>, CallReport) {
        let callee = trail::Callee {
            name: &self.name,
            sha256: &self.sha256,
            audit_arguments: self.grant.audit_arguments,
        };
        let admit = || self.admit_call(caller, function, args);
        let rule = self.grant.approval.rule(function);
        let gate = self
            .manifest
            .functions
            .iter()
            .find(|f| f.name == function)
            .filter(|f| rule.applies_to(f))
            .map(|_| trail::Gate {
                approvals: &self.approvals,
                rule,
                estop: &self.estop,
            });
        let run = |()| async {
            let mut report = CallReport::default();
            let (out, bytes) = match self.acquire(self.is_stop(function)).await {
                Err(e) => (Err(e), 0),
                Ok(_permits) => {
                    let text = self
                        .run(Some(function), &args.to_string(), &mut report)
                        .await;
                    let bytes = text.as_ref().map_or(0, String::len);
                    let value = text.and_then(|t| {
                        serde_json::from_str(&t).map_err(|e| PluginError::Output {
                            plugin: self.name.clone(),
                            msg: format!("the result is not JSON: {e}"),
                        })
                    });
                    if let (Ok(_), Some(rules)) = (&value, self.rules(function)) {
                        self.rate.succeeded(rules, function, args);
                    }
                    (value, bytes)
                }
            };
            (out, bytes, report)
        };
        trail::audited(
            self.audit.as_deref(),
            callee,
            caller,
            function,
            args,
            admit,
            gate,
            run,
        )
        .await
    }

    /// Checks the function exists, the e-stop lets it run, the arguments satisfy its schema, and the
    /// grant's rate limits and budgets leave room for it (counting it).
    fn admit_call(&self, caller: &Caller, function: &str, args: &Value) -> Result<(), PluginError> {
        if self.tools.get(function).is_none() {
            return Err(PluginError::UnknownFunction {
                plugin: self.name.clone(),
                function: function.to_owned(),
            });
        }
        if self.estop.latched() && !self.always_runs(function) {
            return Err(self.estopped(function));
        }
        let call = thorn_tools::ParsedCall {
            name: function.to_owned(),
            arguments: args.clone(),
        };
        self.tools.check(&call)?;
        if let Some(rules) = self.rules(function) {
            let (key, request) = (caller.key_id.as_deref(), caller.request.as_deref());
            self.rate
                .admit(
                    rules,
                    function,
                    key,
                    request,
                    args,
                    Instant::now(),
                    crate::rate::today(),
                )
                .map_err(|msg| PluginError::RateLimited {
                    plugin: self.name.clone(),
                    function: function.to_owned(),
                    msg,
                })?;
        }
        Ok(())
    }

    /// The grant's rate limits and budgets for `function` (its own, else the plugin's `"*"`); none for a
    /// stop, which nothing may hold back.
    fn rules(&self, function: &str) -> Option<&crate::RateRules> {
        if self.is_stop(function) {
            return None;
        }
        let r = &self.grant.rates;
        r.get(function).or_else(|| r.get("*"))
    }

    /// The manifest's deadman of `function`, if it has one.
    pub fn deadman(&self, function: &str) -> Option<&crate::Deadman> {
        self.manifest
            .functions
            .iter()
            .find(|f| f.name == function)
            .and_then(|f| f.deadman.as_ref())
    }

    /// How long a motion of `function` may last: its manifest's deadman, or the operator's shorter one.
    fn deadman_limit(&self, function: &str) -> Option<Duration> {
        let own = self.deadman(function)?.max;
        Some(
            self.grant
                .deadman
                .get(function)
                .map_or(own, |&d| d.min(own)),
        )
    }

    /// Whether `function` is marked `"stop": true`.
    fn is_stop(&self, function: &str) -> bool {
        self.manifest
            .functions
            .iter()
            .any(|f| f.name == function && f.stop)
    }

    /// Whether `function` runs whatever the e-stop says (a stop, or read-only).
    fn always_runs(&self, function: &str) -> bool {
        self.manifest
            .functions
            .iter()
            .find(|f| f.name == function)
            .is_some_and(Estop::always_runs)
    }

    fn estopped(&self, function: &str) -> PluginError {
        PluginError::Estopped {
            plugin: self.name.clone(),
            function: function.to_owned(),
        }
    }

    /// Waits (at most the call's time limit) for one of the plugin's own slots and then a pool slot. A
    /// stop takes no slot of the plugin's own: it must not wait behind the motions it stops.
    async fn acquire(
        &self,
        stop: bool,
    ) -> Result<
        (
            Option<tokio::sync::SemaphorePermit<'_>>,
            tokio::sync::SemaphorePermit<'_>,
        ),
        PluginError,
    > {
        let wait = self.grant.limits.timeout;
        let busy = || PluginError::Busy {
            plugin: self.name.clone(),
            after: wait,
            limit: self.grant.limits.max_concurrent,
        };
        let both = async {
            let a = match stop {
                true => None,
                false => Some(self.own.acquire().await.ok()?),
            };
            let b = self.slots.acquire().await.ok()?;
            Some((a, b))
        };
        match tokio::time::timeout(wait, both).await {
            Ok(Some(p)) => Ok(p),
            _ => Err(busy()),
        }
    }

    /// One fresh instance, one export call (`describe` when `function` is `None`).
    pub(crate) async fn run(
        &self,
        function: Option<&str>,
        args: &str,
        report: &mut CallReport,
    ) -> Result<String, PluginError> {
        let lim = &self.grant.limits;
        let (mut store, stdout, stderr) = self.store()?;
        let fuel = lim.fuel.unwrap_or(u64::MAX);
        let fut = async {
            let tool = self.pre.instantiate_async(&mut store).await?;
            let out: Result<String, String> = match function {
                None => Ok(tool.call_describe(&mut store).await?),
                Some(name) => tool.call_call(&mut store, name, args).await?,
            };
            let used = store.get_fuel().ok().map(|left| fuel - left);
            wasmtime::Result::Ok((out, used))
        };
        // A call the e-stop stops ends when it latches: the guest yields every epoch tick (and a host
        // call such as `sleep` is a wait), so the instance is dropped within a tick.
        let interruptible = function.is_some_and(|f| !self.always_runs(f));
        let deadman = function.and_then(|f| self.deadman_limit(f));
        let res = tokio::select! {
            r = tokio::time::timeout(lim.timeout, fut) => r,
            () = self.estop.until_latched(), if interruptible => {
                return Err(self.estopped(function.unwrap_or_default()));
            }
            () = tokio::time::sleep(deadman.unwrap_or_default()), if deadman.is_some() => {
                return Err(PluginError::Deadman {
                    plugin: self.name.clone(),
                    function: function.unwrap_or_default().to_owned(),
                    why: format!(
                        "the motion ran longer than its limit of {} ms",
                        deadman.unwrap_or_default().as_millis()
                    ),
                });
            }
        };
        report.stdout = String::from_utf8_lossy(&stdout.contents()).into_owned();
        report.stderr = String::from_utf8_lossy(&stderr.contents()).into_owned();
        let plugin = || self.name.clone();
        let (out, used) = match res {
            Err(_) => {
                return Err(PluginError::Timeout {
                    plugin: plugin(),
                    after: lim.timeout,
                });
            }
            Ok(Err(e)) => return Err(self.classify(e, &report.stderr)),
            Ok(Ok(v)) => v,
        };
        report.fuel = lim.fuel.and(used);
        let text = out.map_err(|e| PluginError::Tool(trail::truncate(e, lim.max_output)))?;
        if text.len() > lim.max_output {
            return Err(PluginError::Output {
                plugin: plugin(),
                msg: format!(
                    "{} bytes, more than the limit of {}",
                    text.len(),
                    lim.max_output
                ),
            });
        }
        Ok(text)
    }

    /// A fresh store holding exactly the grant, and its captured stdout and stderr.
    fn store(&self) -> Result<(Store<State>, MemoryOutputPipe, MemoryOutputPipe), PluginError> {
        sandbox::store(&self.engine, &self.name, &self.grant, &self.lookup_names)
    }

    /// Turns a wasmtime error into the error a user can act on.
    fn classify(&self, e: wasmtime::Error, stderr: &str) -> PluginError {
        sandbox::classify(e, &self.name, &self.grant.limits, stderr)
    }
}
