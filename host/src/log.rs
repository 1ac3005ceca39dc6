//! What thorn writes to stderr, and in which form (`--log-format`).
//!
//! Two kinds of lines: *status* (what a command tells its operator: the model loaded, the address it
//! serves, a plugin refused; target `thorn::status`, always on) and *log* events (the access log at INFO,
//! the rest at WARN unless `THORN_LOG` says otherwise, an `EnvFilter` directive such as
//! `info,thorn::access=off`). As text, a status line is its message alone and a log event carries its
//! time, level and target; as JSON, every line is one object with `timestamp`, `level`, `target` and the
//! event's fields at the top level. Colour only when stderr is a terminal.
//!
//! With `--otlp-endpoint`, the spans (a request, its rounds, its tool calls) also go to an OpenTelemetry
//! collector over OTLP/HTTP (protobuf or JSON), batched on a thread of their own and flushed when the
//! process ends ([`LogGuard`]).

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

/// The OTLP encoding (`--otlp-protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// `application/x-protobuf` (OTLP's default).
    #[value(name = "http/protobuf")]
    HttpProtobuf,
    /// `application/json`.
    #[value(name = "http/json")]
    HttpJson,
}

/// Flushes the traces not yet sent when dropped (at the end of `main`).
#[must_use]
pub struct LogGuard(Option<opentelemetry_sdk::trace::SdkTracerProvider>);

impl Drop for LogGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("warning: traces not all sent to the OTLP collector: {e}");
        }
    }
}

/// The tracer provider exporting to the collector at `endpoint` (its base URL).
fn otlp(
    endpoint: &str,
    protocol: OtlpProtocol,
) -> anyhow::Result<opentelemetry_sdk::trace::SdkTracerProvider> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    // The process's TLS roots (the system's and --tls-ca) for an https collector.
    let client = reqwest::blocking::Client::builder()
        .tls_backend_preconfigured((*thorn_plugin::tls::client()).clone())
        .timeout(std::time::Duration::from_secs(10))
        .build()?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(url)
        .with_protocol(match protocol {
            OtlpProtocol::HttpProtobuf => opentelemetry_otlp::Protocol::HttpBinary,
            OtlpProtocol::HttpJson => opentelemetry_otlp::Protocol::HttpJson,
        })
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("thorn")
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Installs the process's subscriber (and, given a collector, the OTLP exporter).
pub fn init(
    format: LogFormat,
    collector: Option<(&str, OtlpProtocol)>,
) -> anyhow::Result<LogGuard> {
    use opentelemetry::trace::TracerProvider;
    let provider = collector.map(|(e, p)| otlp(e, p)).transpose()?;
    // thorn's own spans (request, round, tool_call) and what happens inside them, at INFO.
    let traced = || Targets::new().with_target("thorn", tracing::Level::INFO);
    let traces = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("thorn"))
            .with_filter(traced())
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let filter = || {
        EnvFilter::try_from_env("THORN_LOG")
            .unwrap_or_else(|_| EnvFilter::new("warn,thorn::access=info"))
    };
    let status = || Targets::new().with_target(STATUS, tracing::Level::INFO);
    let not_status = || filter_fn(|m| m.target() != STATUS);
    let registry = tracing_subscriber::registry().with(traces);
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
    Ok(LogGuard(provider))
}
