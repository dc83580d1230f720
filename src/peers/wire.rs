//! The bodies workers exchange on the peer exchange: a query for a master
//! by name, and the offers of the workers that hold it (verified, with the
//! facts of its sidecar) or are downloading it. Plain data: the broker side
//! carries them, the pipeline decides what an offer is worth.

use crate::image_format::{Format, ServedFormat};
use crate::optional_digest;
use serde::{Deserialize, Serialize};

/// Routing key prefix of queries on the peer exchange (`query.<name>`).
pub const QUERY_KEY: &str = "query";

/// A worker asks who holds master `name`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    /// The master's name in the cache (Ironic's name for it).
    pub name: String,
    /// The conductor host asking (a worker of the same host never answers:
    /// it shares the asker's cache).
    pub host: String,
    /// The asking process (random per process), so it never answers itself.
    pub process: String,
}

/// Whether an offered master is ready to be fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OfferState {
    /// Committed and verified: fetch it.
    Verified,
    /// Being downloaded from its source by the holder of the cloud-wide
    /// claim: wait for it.
    Downloading,
}

/// A worker's answer to a [`Query`]: what it holds under that name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// The master's name.
    pub name: String,
    /// The answering conductor host.
    pub host: String,
    /// The answering process.
    pub process: String,
    /// Its peer listener (`[peers]url`), without a trailing slash.
    pub url: String,
    /// Verified or downloading.
    pub state: OfferState,
    /// What its sidecar records (absent while downloading).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master: Option<OfferedMaster>,
    /// While downloading: the size the master will have, when its listener
    /// already streams it as it is written (see `live`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_size: Option<u64>,
}

/// The sidecar facts of an offered master: the served bytes' size and
/// digests, and what was verified of its source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedMaster {
    /// Size of the master's bytes.
    pub size: u64,
    /// MD5 of the master's bytes, when computed. Sent as an empty string
    /// when absent: earlier versions read a string.
    #[serde(default, with = "optional_digest")]
    pub md5: Option<String>,
    /// SHA-256 of the master's bytes.
    pub sha256: String,
    /// SHA-512 of the master's bytes, when computed.
    #[serde(default)]
    pub sha512: Option<String>,
    /// Whether the master is a conversion of its source.
    pub converted: bool,
    /// The master's disk format as announced to the agent.
    pub disk_format: ServedFormat,
    /// The format detected in the source bytes.
    pub source_format: Format,
    /// The image source, its secrets masked.
    pub source: String,
    /// Unix time the source download started.
    pub fetched_at: u64,
    /// The source's Last-Modified, when known (unix s).
    #[serde(default)]
    pub source_last_modified: Option<u64>,
    /// Size of the source bytes.
    pub source_size: u64,
    /// MD5 of the source bytes, when computed.
    #[serde(default)]
    pub source_md5: Option<String>,
    /// SHA-256 of the source bytes, when computed.
    #[serde(default)]
    pub source_sha256: Option<String>,
    /// SHA-512 of the source bytes, when computed.
    #[serde(default)]
    pub source_sha512: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_reads_back_as_written() {
        let offer = Offer {
            name: "abc.converted".into(),
            host: "c1".into(),
            process: "p".into(),
            url: "http://10.0.0.1:8089".into(),
            state: OfferState::Downloading,
            master: None,
            live_size: Some(1 << 30),
        };
        let text = serde_json::to_string(&offer).unwrap();
        assert!(text.contains("\"state\":\"downloading\""), "{text}");
        assert!(text.contains("\"live_size\":1073741824"), "{text}");
        assert_eq!(serde_json::from_str::<Offer>(&text).unwrap(), offer);
    }

    /// An offer as every earlier worker sent it (formats by their
    /// lower-case names) reads as typed formats and is sent again byte for
    /// byte; one naming a format this version does not know (or `gpt` as
    /// served) does not read, and is dropped as any malformed offer.
    #[test]
    fn an_offer_keeps_its_bytes_with_typed_formats() {
        let sent = concat!(
            r#"{"name":"abc","host":"c1","process":"p","url":"http://10.0.0.1:8089","#,
            r#""state":"verified","master":{"size":5,"md5":"","sha256":"b","sha512":null,"#,
            r#""converted":false,"disk_format":"raw","source_format":"gpt","#,
            r#""source":"http://example.com/m","fetched_at":1,"source_last_modified":null,"#,
            r#""source_size":5,"source_md5":null,"source_sha256":"b","source_sha512":null}}"#,
        );
        let offer: Offer = serde_json::from_str(sent).unwrap();
        let master = offer.master.as_ref().unwrap();
        assert_eq!(master.source_format, Format::Gpt);
        assert_eq!(master.disk_format, Format::Gpt.served());
        assert_eq!(serde_json::to_string(&offer).unwrap(), sent);
        for (field, name) in [
            ("\"source_format\":\"gpt\"", "\"source_format\":\"floppy\""),
            ("\"disk_format\":\"raw\"", "\"disk_format\":\"gpt\""),
        ] {
            let unknown = sent.replace(field, name);
            assert!(serde_json::from_str::<Offer>(&unknown).is_err(), "{name}");
        }
    }

    /// A master offered without an MD5 says so with an empty string, which
    /// an earlier worker (holding the MD5 as a plain string) reads, and
    /// an earlier worker's empty string reads as no MD5.
    #[test]
    fn an_offered_master_without_md5_crosses_versions() {
        let master = OfferedMaster {
            size: 5,
            md5: None,
            sha256: "b".into(),
            sha512: None,
            converted: false,
            disk_format: Format::Raw.served(),
            source_format: Format::Raw,
            source: "http://example.com/m".into(),
            fetched_at: 1,
            source_last_modified: None,
            source_size: 5,
            source_md5: None,
            source_sha256: None,
            source_sha512: None,
        };
        let text = serde_json::to_value(&master).unwrap();
        assert_eq!(text["md5"], "", "{text}");
        assert_eq!(
            serde_json::from_value::<OfferedMaster>(text).unwrap(),
            master
        );
        let mut with_md5 = serde_json::to_value(&master).unwrap();
        with_md5["md5"] = "a".into();
        let read: OfferedMaster = serde_json::from_value(with_md5).unwrap();
        assert_eq!(read.md5.as_deref(), Some("a"));
    }
}
