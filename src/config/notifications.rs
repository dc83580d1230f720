//! `[notifications]`: which nodes Ironic's notifications may act on, and
//! for how long.

use serde::{Deserialize, Serialize};

/// `[notifications]`: the worker acts on Ironic's notifications only for
/// nodes that delegate their image work to it; Ironic fails its own deploy
/// when the worker links the files of a node Ironic prepares itself.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct NotificationsSection {
    /// Deploy interfaces (the payload's `deploy_interface`) whose nodes are
    /// acted on; `*` means every node.
    #[serde(deserialize_with = "super::value::list_opt")]
    pub deploy_interfaces: Vec<String>,
    /// Seconds after which a notification's prepare is not started any
    /// more (the deploy interface has given up on it by then; its
    /// `[image_worker]prepare_timeout` is 1800).
    pub max_age: u64,
}

impl Default for NotificationsSection {
    fn default() -> Self {
        NotificationsSection {
            deploy_interfaces: vec!["direct-worker".into()],
            max_age: 1800,
        }
    }
}
