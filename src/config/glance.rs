//! `[glance]`: the Image API and its Keystone credentials, with the names
//! of ironic.conf's `[glance]` (keystoneauth) options.

use serde::{Deserialize, Serialize};

/// `[glance]`: where Glance is and how to authenticate to it. The names are
/// those of ironic.conf's `[glance]` (keystoneauth) options.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlanceSection {
    /// Image API base URL (without `/v2`); when empty, the `image` endpoint
    /// of the Keystone catalog is used.
    pub endpoint_override: String,
    /// `password`/`v3password`, `v3applicationcredential`, `admin_token`
    /// (a static token, sent as it is) or `none`/`noauth`.
    pub auth_type: String,
    /// Keystone URL (`.../v3` or its root).
    pub auth_url: String,
    /// Password authentication: user name.
    pub username: String,
    /// Password authentication: password (never logged).
    pub password: String,
    /// Domain of the user, by name.
    pub user_domain_name: String,
    /// Domain of the user, by id.
    pub user_domain_id: String,
    /// Project to scope the token to, by name.
    pub project_name: String,
    /// Project to scope the token to, by id.
    pub project_id: String,
    /// Domain of the project, by name.
    pub project_domain_name: String,
    /// Domain of the project, by id.
    pub project_domain_id: String,
    /// Application credential id.
    pub application_credential_id: String,
    /// Application credential secret (never logged).
    pub application_credential_secret: String,
    /// Static token for `admin_token` (never logged).
    pub token: String,
    /// Catalog region of the image endpoint.
    pub region_name: String,
    /// Catalog interfaces to try, in order.
    #[serde(deserialize_with = "super::value::list_opt")]
    pub valid_interfaces: Vec<String>,
    /// Skip TLS verification of Keystone and Glance.
    pub insecure: bool,
}

impl Default for GlanceSection {
    fn default() -> Self {
        GlanceSection {
            endpoint_override: String::new(),
            auth_type: "password".into(),
            auth_url: String::new(),
            username: String::new(),
            password: String::new(),
            user_domain_name: String::new(),
            user_domain_id: String::new(),
            project_name: String::new(),
            project_id: String::new(),
            project_domain_name: String::new(),
            project_domain_id: String::new(),
            application_credential_id: String::new(),
            application_credential_secret: String::new(),
            token: String::new(),
            region_name: String::new(),
            valid_interfaces: vec!["internal".into(), "public".into()],
            insecure: false,
        }
    }
}
