//! The operator's controls over every call one process makes: the e-stop latch and the approvals queue.
//! One of each per process, shared by every plugin host, plugin and external server it loads (a reload
//! keeps them), and by the admin API that operates them.

use crate::{Approvals, Estop};
use std::sync::Arc;

/// The e-stop latch and the approvals queue (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Controls {
    /// The e-stop latch.
    pub estop: Arc<Estop>,
    /// The calls waiting for a person's approval.
    pub approvals: Arc<Approvals>,
}

impl Controls {
    /// The controls around `estop`, with an empty approvals queue.
    pub fn new(estop: Arc<Estop>) -> Self {
        Controls {
            estop,
            approvals: Arc::default(),
        }
    }
}
