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
    pub auth_type: GlanceAuthType,
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

/// `[glance]auth_type`: the keystoneauth plugins the worker speaks, read
/// once. An ironic.conf may name any plugin, and Glance may never be used:
/// another name is kept, not refused at start, and refused when Glance is
/// used (as before there was this type).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(from = "String", into = "String")]
pub enum GlanceAuthType {
    /// `password` or `v3password`: a Keystone token for a user.
    Password,
    /// `v3applicationcredential` or `applicationcredential`: a Keystone
    /// token for an application credential.
    ApplicationCredential,
    /// `admin_token`: the static `token`, sent as it is.
    AdminToken,
    /// `none` or `noauth`: no token at all.
    NoAuth,
    /// Any other plugin name, as written.
    Unsupported(String),
}

impl GlanceAuthType {
    /// The plugin's name, as the configuration writes it.
    pub fn as_str(&self) -> &str {
        match self {
            GlanceAuthType::Password => "password",
            GlanceAuthType::ApplicationCredential => "v3applicationcredential",
            GlanceAuthType::AdminToken => "admin_token",
            GlanceAuthType::NoAuth => "none",
            GlanceAuthType::Unsupported(name) => name,
        }
    }
}

impl From<String> for GlanceAuthType {
    fn from(name: String) -> Self {
        match name.as_str() {
            "password" | "v3password" => GlanceAuthType::Password,
            "v3applicationcredential" | "applicationcredential" => {
                GlanceAuthType::ApplicationCredential
            }
            "admin_token" => GlanceAuthType::AdminToken,
            "none" | "noauth" => GlanceAuthType::NoAuth,
            _ => GlanceAuthType::Unsupported(name),
        }
    }
}

impl From<GlanceAuthType> for String {
    fn from(auth: GlanceAuthType) -> String {
        auth.as_str().to_string()
    }
}

impl Default for GlanceSection {
    fn default() -> Self {
        GlanceSection {
            endpoint_override: String::new(),
            auth_type: GlanceAuthType::Password,
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

#[cfg(test)]
mod tests {
    use super::super::choice::refusal;
    use super::GlanceAuthType;

    #[test]
    fn auth_type_names_a_plugin_and_another_is_kept_for_later() {
        for (name, auth) in [
            ("password", GlanceAuthType::Password),
            ("v3password", GlanceAuthType::Password),
            (
                "v3applicationcredential",
                GlanceAuthType::ApplicationCredential,
            ),
            (
                "applicationcredential",
                GlanceAuthType::ApplicationCredential,
            ),
            ("admin_token", GlanceAuthType::AdminToken),
            ("none", GlanceAuthType::NoAuth),
            ("noauth", GlanceAuthType::NoAuth),
        ] {
            assert_eq!(GlanceAuthType::from(name.to_string()), auth, "{name}");
        }
        assert_eq!(GlanceAuthType::AdminToken.as_str(), "admin_token");
        let kerberos = GlanceAuthType::from("kerberos".to_string());
        assert_eq!(kerberos, GlanceAuthType::Unsupported("kerberos".into()));
        assert_eq!(serde_json::to_value(kerberos).unwrap(), "kerberos");
        assert_eq!(refusal(&["glance.auth_type=kerberos"]), None);
    }
}
