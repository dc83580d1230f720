//! Options that take one of a few words: each is an enum, parsed once when
//! the configuration is read (a word it does not know is refused there,
//! naming the option and the words it takes) and matched as an enum
//! wherever the worker acts on it. `config show` prints the word again.
//! Also the two choices several sections share: an HTTP Basic strategy
//! and the lowest TLS version of a listener.

/// Declares the enum of an option that takes one of a few words, each
/// variant with its word (printed back by `config show`) and the other
/// spellings accepted for it: the spellings are written once, here, for
/// both reading and printing. A word that is none of them is refused with
/// the message given, `{value:?}` standing for the word.
macro_rules! choice {
    (
        $(#[$attr:meta])*
        pub enum $name:ident refused as $refusal:literal {
            $(
                $(#[$variant_attr:meta])*
                $variant:ident = $word:literal $(| $alias:literal)*
            ),+ $(,)?
        }
    ) => {
        $(#[$attr])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
        #[serde(try_from = "String")]
        pub enum $name {
            $(
                $(#[$variant_attr])*
                #[serde(rename = $word)]
                $variant,
            )+
        }

        impl $name {
            /// The word of this choice, as the configuration writes it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;

            fn from_str(value: &str) -> Result<Self, String> {
                match value {
                    $($word $(| $alias)* => Ok($name::$variant),)+
                    _ => Err(format!($refusal, value = value)),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;

            fn try_from(value: String) -> Result<Self, String> {
                value.parse()
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub(super) use choice;

/// The refusal of a configuration given these `--set` flags (`None`: it
/// loads), for the tests of each option's words.
#[cfg(test)]
pub(super) fn refusal(flags: &[&str]) -> Option<String> {
    let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    super::Config::load_from(&super::Files::default(), &[], &flags)
        .err()
        .map(|e| e.message)
}

choice! {
    /// An HTTP Basic set-up (`[http]auth_strategy`,
    /// `[deploy]image_server_auth_strategy`, `[json_rpc]auth_strategy`):
    /// Ironic's two strategies, with the same names.
    pub enum AuthStrategy refused as "unknown value {value:?} (noauth or http_basic)" {
        /// No authentication.
        NoAuth = "noauth",
        /// HTTP Basic, against the section's credentials.
        HttpBasic = "http_basic",
    }
}

choice! {
    /// The lowest TLS version a listener accepts (`[http]tls_min_version`,
    /// `[json_rpc]tls_min_version`).
    pub enum TlsMinVersion refused as "{value:?}: 1.2 or 1.3" {
        /// TLS 1.2 and 1.3.
        Tls12 = "1.2",
        /// TLS 1.3 only.
        Tls13 = "1.3",
    }
}

#[cfg(test)]
mod tests {
    use super::{AuthStrategy, TlsMinVersion, refusal};

    #[test]
    fn auth_strategy_takes_ironics_two_words() {
        assert_eq!("noauth".parse(), Ok(AuthStrategy::NoAuth));
        assert_eq!("http_basic".parse(), Ok(AuthStrategy::HttpBasic));
        assert_eq!(AuthStrategy::HttpBasic.to_string(), "http_basic");
        // `config show` prints the word again.
        let shown = serde_json::to_value(AuthStrategy::HttpBasic).unwrap();
        assert_eq!(shown, "http_basic");
        let refused = "unknown value \"keystone\" (noauth or http_basic)";
        assert_eq!("keystone".parse::<AuthStrategy>(), Err(refused.into()));
        for option in [
            "http.auth_strategy",
            "deploy.image_server_auth_strategy",
            "json_rpc.auth_strategy",
        ] {
            let error = refusal(&[&format!("{option}=keystone")]).unwrap();
            let (section, name) = option.split_once('.').unwrap();
            assert!(error.contains(&format!("[{section}]{name} ")), "{error}");
            assert!(error.contains(refused), "{error}");
        }
    }

    #[test]
    fn tls_min_version_is_1_2_or_1_3() {
        assert_eq!("1.2".parse(), Ok(TlsMinVersion::Tls12));
        assert_eq!("1.3".parse(), Ok(TlsMinVersion::Tls13));
        assert_eq!(TlsMinVersion::Tls12.as_str(), "1.2");
        assert_eq!(
            "1.1".parse::<TlsMinVersion>(),
            Err("\"1.1\": 1.2 or 1.3".into())
        );
        let error = refusal(&["json_rpc.tls_min_version=1.1"]).unwrap();
        assert!(
            error.contains("[json_rpc]tls_min_version (--set json_rpc.tls_min_version): \"1.1\""),
            "{error}"
        );
    }
}
