//! The upstreams a server was started with ([`Upstreams`]): a request's `model` resolved to a
//! [`Target`] (`NAME/MODEL`, a bare id an upstream lists, or `NAME`), and the `--local-first` upstream.

use super::{SpecError, Upstream, UpstreamError, UpstreamSpec};
use std::sync::Arc;

/// A model a request named, resolved to an upstream.
#[derive(Debug, Clone)]
pub struct Target {
    /// The upstream.
    pub upstream: Arc<Upstream>,
    /// Its own id for the model (sent upstream).
    pub model: String,
}

impl Target {
    /// The model as thorn's clients name it: `NAME/MODEL`.
    pub fn exposed(&self) -> String {
        format!("{}/{}", self.upstream.name(), self.model)
    }
}

/// The upstreams a server was started with.
#[derive(Debug, Default, Clone)]
pub struct Upstreams {
    list: Vec<Arc<Upstream>>,
    local_first: Option<usize>,
}

impl Upstreams {
    /// The upstreams of `specs` (keys read now); `local_first` names the one that takes the local
    /// model's overflow.
    pub fn new(specs: Vec<UpstreamSpec>, local_first: Option<&str>) -> Result<Self, SpecError> {
        let mut list: Vec<Arc<Upstream>> = Vec::new();
        for s in specs {
            if list.iter().any(|u| u.name() == s.name) {
                return Err(SpecError {
                    spec: s.name.clone(),
                    why: "two upstreams have this name".into(),
                });
            }
            list.push(Arc::new(Upstream::new(s)?));
        }
        let local_first = match local_first {
            None => None,
            Some(n) => Some(
                list.iter()
                    .position(|u| u.name() == n)
                    .ok_or_else(|| SpecError {
                        spec: n.to_owned(),
                        why: "--local-first names no --upstream".into(),
                    })?,
            ),
        };
        Ok(Upstreams { list, local_first })
    }

    /// None configured.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// All of them.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Upstream>> {
        self.list.iter()
    }

    /// The local model's overflow upstream.
    pub fn local_first(&self) -> Option<&Arc<Upstream>> {
        self.local_first.map(|i| &self.list[i])
    }

    /// The upstream model `model` names: `NAME/MODEL` (any model, when NAME has listed none), `NAME`
    /// (its first model), or a bare id an upstream lists. `Ok(None)`: no upstream's.
    pub fn resolve(&self, model: &str) -> Result<Option<Target>, UpstreamError> {
        let target = |u: &Arc<Upstream>, m: &str| Target {
            upstream: Arc::clone(u),
            model: m.to_owned(),
        };
        for u in &self.list {
            if model == u.name() {
                let first = u
                    .models()
                    .into_iter()
                    .next()
                    .ok_or(UpstreamError::NoModel {
                        name: u.name().to_owned(),
                    })?;
                return Ok(Some(target(u, &first)));
            }
            if let Some(m) = model
                .strip_prefix(u.name())
                .and_then(|r| r.strip_prefix('/'))
            {
                let listed = u.models();
                if listed.is_empty() || listed.iter().any(|l| l == m) {
                    return Ok(Some(target(u, m)));
                }
                return Ok(None);
            }
        }
        Ok(self
            .list
            .iter()
            .find(|u| u.has_model(model))
            .map(|u| target(u, model)))
    }

    /// The first model of the local-first upstream (the "large" class).
    pub fn large(&self) -> Result<Option<Target>, UpstreamError> {
        match self.local_first() {
            None => Ok(None),
            Some(u) => self.resolve(u.name()),
        }
    }

    /// Checks each once (at start: failures are reported, not fatal; the health loop retries).
    pub async fn check_all(&self) -> Vec<(String, Result<(), UpstreamError>)> {
        let mut out = Vec::new();
        for u in &self.list {
            out.push((u.name().to_owned(), u.check().await));
        }
        out
    }

    /// Starts each one's health loop on the current runtime.
    pub fn spawn_health(&self) {
        for u in &self.list {
            tokio::spawn(Arc::clone(u).health_loop());
        }
    }
}
