//! What a plugin is granted: its directories, env vars and outbound TCP rules ([`Grant`]), and what its
//! manifest asks for ([`Requests`]).

use super::*;

/// A directory mapped into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preopen {
    /// The host directory.
    pub host: PathBuf,
    /// Where the plugin sees it.
    pub guest: String,
    /// Whether it may write.
    pub write: bool,
}

/// One outbound TCP rule: a host (name or address) and a port (`None` = any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetRule {
    /// As written.
    pub host: String,
    /// The port, or any.
    pub port: Option<u16>,
    /// The addresses `host` resolved to when the plugin loaded.
    pub addrs: Vec<IpAddr>,
}

impl NetRule {
    /// Parses `host:port` (`port` may be `*`); IPv6 literals go in brackets.
    pub fn parse(s: &str) -> Option<(String, Option<u16>)> {
        let (host, port) = s.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return None;
        }
        let port = match port {
            "*" => None,
            p => Some(p.parse().ok()?),
        };
        Some((host.to_ascii_lowercase(), port))
    }

    pub(super) fn resolve(host: String, port: Option<u16>) -> NetRule {
        let addrs = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => match (host.as_str(), 0).to_socket_addrs() {
                Ok(it) => it.map(|a| a.ip()).collect(),
                Err(e) => {
                    tracing::warn!(%host, error = %e, "a granted host does not resolve; connections to it will fail");
                    Vec::new()
                }
            },
        };
        NetRule { host, port, addrs }
    }

    /// Whether a connection to `addr` is allowed.
    pub fn allows(&self, addr: SocketAddr) -> bool {
        self.port.is_none_or(|p| p == addr.port()) && self.addrs.contains(&addr.ip())
    }
}

/// What a plugin gets: the capabilities it asked for and was granted, and its limits.
#[derive(Debug, Clone, Default)]
pub struct Grant {
    /// Directories.
    pub preopens: Vec<Preopen>,
    /// Environment variables.
    pub env: Vec<(String, String)>,
    /// Outbound TCP.
    pub network: Vec<NetRule>,
    /// Per-call limits.
    pub limits: Limits,
    /// Whether calls' arguments go into the audit log (else only their digest).
    pub audit_arguments: bool,
    /// Rate limits and budgets by function name (`"*"`: every function without its own).
    pub rates: BTreeMap<String, crate::RateRules>,
    /// Which calls wait for a person's approval.
    pub approval: crate::ApprovalRules,
    /// Function name -> the operator's limit on its motions (over the manifest's deadman, never longer).
    pub deadman: BTreeMap<String, Duration>,
}

impl Grant {
    /// Nothing granted, with these limits.
    pub fn none(limits: Limits) -> Self {
        Grant {
            limits,
            ..Grant::default()
        }
    }
}

/// What a manifest asks for, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requests {
    /// `(guest path, access)`.
    pub filesystem: Vec<(String, Access)>,
    /// Variable names.
    pub env: Vec<String>,
    /// `host:port` patterns.
    pub network: Vec<String>,
}

impl Requests {
    /// Reads the `capabilities` object of a (schema-valid) manifest.
    pub fn of(manifest: &Manifest) -> Self {
        let c = &manifest.capabilities;
        let strings = |k: &str| -> Vec<String> {
            c[k].as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let filesystem = c["filesystem"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|f| {
                        let access = if f["access"] == "read-write" {
                            Access::ReadWrite
                        } else {
                            Access::Read
                        };
                        (f["path"].as_str().unwrap_or("").to_owned(), access)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Requests {
            filesystem,
            env: strings("env"),
            network: strings("network"),
        }
    }

    /// Whether it asks for nothing.
    pub fn is_empty(&self) -> bool {
        self.filesystem.is_empty() && self.env.is_empty() && self.network.is_empty()
    }

    /// Each request in words, e.g. `directory /data (read)`.
    pub fn describe(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .filesystem
            .iter()
            .map(|(p, a)| format!("directory {p} ({})", a.as_str()))
            .collect();
        out.extend(self.env.iter().map(|e| format!("env {e}")));
        out.extend(self.network.iter().map(|n| format!("network {n}")));
        out
    }
}
