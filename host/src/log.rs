//! What thorn writes to stderr, and in which form (`--log-format`).
//!
//! Two kinds of lines: *status* (what a command tells its operator: the model loaded, the address it
//! serves, a plugin refused; target `thorn::status`, always on) and *log* events (the access log at INFO,
//! the rest at WARN unless `THORN_LOG` says otherwise, an `EnvFilter` directive such as
//! `info,thorn::access=off`). As text, a status line is its message alone and a log event carries its
//! time, level and target; as JSON, every line is one object with `timestamp`, `level`, `target` and the
//! event's fields at the top level. Colour only when stderr is a terminal.

use tracing_subscriber::Layer;
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The form of stderr's lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people.
    #[default]
    Text,
    /// One JSON object per line (for a log collector).
    Json,
}

/// The target of status lines.
pub const STATUS: &str = "thorn::status";

/// A status line (see the module's docs): `status!("serving on {addr}")`.
macro_rules! status {
    ($($arg:tt)*) => { ::tracing::info!(target: "thorn::status", $($arg)*) };
}

/// A status line about something the operator should look at.
macro_rules! status_warn {
    ($($arg:tt)*) => { ::tracing::warn!(target: "thorn::status", $($arg)*) };
}

/// Installs the process's subscriber.
pub fn init(format: LogFormat) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let filter = || {
        EnvFilter::try_from_env("THORN_LOG")
            .unwrap_or_else(|_| EnvFilter::new("warn,thorn::access=info"))
    };
    let status = || Targets::new().with_target(STATUS, tracing::Level::INFO);
    let not_status = || filter_fn(|m| m.target() != STATUS);
    let registry = tracing_subscriber::registry();
    match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(false)
                    .without_time()
                    .with_level(false)
                    .with_target(false)
                    .with_filter(status()),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(ansi)
                    .with_filter(filter().and(not_status())),
            )
            .init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(true)
                    .with_writer(std::io::stderr)
                    .with_filter(status().or(filter().and(not_status()))),
            )
            .init(),
    }
}
