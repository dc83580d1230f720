//! `[metrics]`: the operations listener (`/metrics`, `/healthz`, `/readyz`).

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// `[metrics]`: the metrics / health listener.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Listen address for `/metrics`, `/healthz`, `/readyz`.
    pub listen: SocketAddr,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            listen: SocketAddr::from(([127, 0, 0, 1], 9102)),
        }
    }
}
