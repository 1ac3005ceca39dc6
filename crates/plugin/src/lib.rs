//! Tool plugins: WASI preview 2 components run in wasmtime with no ambient authority.
//!
//! * One [`PluginHost`] per process owns the wasmtime `Engine` (Cranelift, epoch interruption, fuel), the
//!   WASI linker (`linker`: wasmtime-wasi with name lookups limited to the grant and no symlink creation),
//!   an epoch ticker thread and a tokio runtime for synchronous callers. It uses the **pooling allocator**
//!   (instance slots, memories and stacks reserved up front, copy-on-write heap images) when the address
//!   space allows and falls back to on-demand allocation otherwise; a semaphore with one permit per slot
//!   sits in front of it, since an exhausted pool is an error, not back-pressure. Components are compiled
//!   once and cached on disk (`cache`: a private directory, each artifact MACed under a per-host key and
//!   bound to the component's sha256 and the engine), so a restart loads native code in milliseconds
//!   instead of recompiling, and the cache cannot swap an approved plugin's code.
//! * [`PluginHost::open`] compiles (or loads) a component, pre-links it (`InstancePre`), calls its
//!   `describe()` in a sandbox with nothing granted and validates the manifest against
//!   `schemas/tool-manifest.schema.json`. Every function's `parameters` becomes a tool with a compiled
//!   `jsonschema` validator. [`Candidate::admit`] then asks the operator's [`Policy`] (sha256 pin,
//!   capabilities) and yields a callable [`Plugin`]; [`PluginHost::load`] does both.
//! * [`Plugin::call_async`] validates the [`Caller`] and the arguments first (a call that violates the schema
//!   never reaches the plugin), records its intent in the [`AuditLog`] (durable before the plugin runs; a
//!   call that cannot be recorded does not run), waits for a slot (the plugin's own concurrency limit, then
//!   the pool's), then runs the function in a **fresh `Store`** (a trap poisons an instance, so none is
//!   reused): a WASI context holding exactly the grant (preopened directories, env vars, a TCP allow-list;
//!   otherwise no env, args, files or sockets), stdout/stderr captured up to a bound, a memory cap over all
//!   of the store's memories (`limiter`), a cap on its resource-table entries (every open file, socket and
//!   stream is one, so this bounds host descriptors), optional fuel, and a deadline enforced twice: epochs
//!   (the guest yields every tick, and is interrupted after the deadline plus a grace period) and a tokio
//!   timeout around the call (for a guest blocked in a host call such as `sleep`). A result, or the tool's
//!   own error message, larger than the output cap is refused or cut. Every failure is a typed
//!   [`PluginError`]; the host keeps serving. The outcome is recorded and made durable before it is returned.

pub mod approval;
pub mod audit;
mod cache;
mod caller;
mod controls;
pub mod deadman;
mod error;
pub mod estop;
pub mod external;
mod host;
mod limiter;
mod linker;
pub mod live;
mod manifest;
mod plugin;
pub mod policy;
pub mod rate;
mod sandbox;
mod set;
pub mod signing;
pub mod tls;
mod trail;

pub use approval::{ApprovalRule, ApprovalRules, Approvals, Approver, DecideError, Pending, Watch};
pub use audit::{AuditError, AuditLog, Outcome, Phase, Record, Rotation};
pub use caller::{Caller, CallerError, MAX_ID_BYTES, validate_conversation_id};
pub use controls::Controls;
pub use deadman::Deadman;
pub use error::PluginError;
pub use estop::{Estop, EstopError, EstopState};
pub use external::McpServer;
pub use host::{Candidate, HostConfig, PluginHost, sha256_hex};
pub use limiter::MemoryCap;
pub use live::{Fingerprint, LiveSet};
pub use manifest::{Annotations, FunctionDef, Limits, MANIFEST_SCHEMA, Manifest};
pub use plugin::{CallReport, Plugin};
pub use policy::{
    Access, Grant, NetRule, Policy, PolicyError, Preopen, Requests, ServerSpec, ServerTransport,
};
pub use rate::{RateRules, RateState};
pub use set::{GrammarCheck, PluginSet, Provider, Refusal, components};
