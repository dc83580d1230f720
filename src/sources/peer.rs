//! Masters fetched from the other workers' peer listeners: one signed GET
//! (`peers::token`) per holder, resumed with `Range` from the same or
//! another holder of the same bytes after a reset or a timeout, never more
//! than the offered size. The bytes go to the receiver as one attempt (see
//! [`Delivery`]), so they are written and hashed in the same pass as a
//! download's; whether they are the offered bytes is the receiver's to
//! check.

use super::{Delivery, SourceStat, deliver};
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::peers::token;
use futures_util::StreamExt;
use std::time::Duration;
use tokio::sync::mpsc;

/// Failed tries of one holder before it is given up for this transfer.
const STRIKES: u32 = 3;

/// A worker offering the master: its peer listener and its host name.
#[derive(Debug, Clone)]
pub struct Holder {
    /// The peer listener's URL, without a trailing slash.
    pub url: String,
    /// The holder's conductor host (for logs).
    pub host: String,
}

/// Why one request to a holder failed: the metric's `reason` label.
pub type Reason = &'static str;

/// The client that fetches masters from peers, with the shared secret.
#[derive(Clone)]
pub struct PeerFetcher {
    client: reqwest::Client,
    secret: std::sync::Arc<Vec<u8>>,
    url_ttl: u64,
}

/// How one GET from a holder ended, short of every byte.
enum Short {
    /// Try this holder again later (reset, timeout, busy).
    Again(Reason),
    /// This holder cannot serve these bytes.
    Drop(Reason),
    /// The receiver stopped: so does the transfer.
    Stop(Error),
}

impl PeerFetcher {
    /// A client with the `[source]` timeouts (the peer listeners are the
    /// operator's own, configured by `[peers]`: no address rule) and the
    /// `[peers]` secret.
    pub fn new(config: &Config) -> Result<PeerFetcher> {
        let client =
            super::http_client::build(config, super::http_client::Purpose::Operator, false)?;
        Ok(PeerFetcher {
            client,
            secret: std::sync::Arc::new(config.peers.load_secret()?),
            url_ttl: config.peers.url_ttl,
        })
    }

    /// Streams master `name`, `size` bytes, from `holders` as one attempt:
    /// each holder in turn from the first byte not yet received, a busy or
    /// failing one left for the next, each given up after [`STRIKES`] (or
    /// at once when it refuses or lacks the master). `failed` hears each
    /// failure's reason.
    pub async fn download(
        &self,
        name: &str,
        size: u64,
        holders: &[Holder],
        to: mpsc::Sender<Delivery>,
        failed: &(dyn Fn(&Holder, Reason) + Sync),
    ) -> Result<SourceStat> {
        let stat = SourceStat {
            last_modified: None,
            size: Some(size),
        };
        deliver(&to, Delivery::Attempt(stat.clone())).await?;
        let mut strikes = vec![0u32; holders.len()];
        let mut got = 0u64;
        let mut turn = 0usize;
        while got < size {
            let Some(i) = (0..holders.len())
                .map(|k| (turn + k) % holders.len())
                .find(|&i| strikes[i] < STRIKES)
            else {
                return Err(Error::new(
                    ErrorCode::SourceUnreachable,
                    format!("master {name}: no peer could serve it ({got} of {size} bytes)"),
                ));
            };
            let holder = &holders[i];
            match self.get_from(holder, name, size, &mut got, &to).await {
                Ok(()) => {}
                Err(Short::Stop(e)) => return Err(e),
                Err(Short::Again(why)) => {
                    failed(holder, why);
                    strikes[i] += 1;
                    turn = i + 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(Short::Drop(why)) => {
                    failed(holder, why);
                    strikes[i] = STRIKES;
                    turn = i + 1;
                }
            }
        }
        deliver(&to, Delivery::Complete).await?;
        Ok(stat)
    }

    /// One GET from `holder` from byte `got` on, delivering what arrives;
    /// Ok when `size` bytes are in.
    async fn get_from(
        &self,
        holder: &Holder,
        name: &str,
        size: u64,
        got: &mut u64,
        to: &mpsc::Sender<Delivery>,
    ) -> std::result::Result<(), Short> {
        let expires = token::now() + self.url_ttl;
        let url = format!(
            "{}{}",
            holder.url,
            token::signed_path(&self.secret, name, expires)
        );
        let mut req = self.client.get(url);
        if *got > 0 {
            req = req.header(reqwest::header::RANGE, format!("bytes={got}-"));
        }
        let resp = req.send().await.map_err(|_| Short::Again("unreachable"))?;
        check_response(&resp, *got, size)?;
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|_| Short::Again("unreachable"))?;
            if *got + chunk.len() as u64 > size {
                return Err(Short::Drop("size"));
            }
            *got += chunk.len() as u64;
            deliver(to, Delivery::Bytes(chunk))
                .await
                .map_err(Short::Stop)?;
        }
        match *got == size {
            true => Ok(()),
            false => Err(Short::Again("short")),
        }
    }
}

/// The status and headers a holder must answer for bytes `from..size`.
fn check_response(
    resp: &reqwest::Response,
    from: u64,
    size: u64,
) -> std::result::Result<(), Short> {
    let status = resp.status().as_u16();
    match status {
        200 if from == 0 => match resp.content_length() {
            Some(len) if len == size => Ok(()),
            _ => Err(Short::Drop("size")),
        },
        206 => {
            let range = resp
                .headers()
                .get(reqwest::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let want = format!("bytes {from}-{}/{size}", size.saturating_sub(1));
            match range == want {
                true => Ok(()),
                false => Err(Short::Drop("size")),
            }
        }
        503 => Err(Short::Again("busy")),
        401 | 403 => Err(Short::Drop("refused")),
        404 => Err(Short::Drop("gone")),
        500..=599 => Err(Short::Again("status")),
        _ => Err(Short::Drop("status")),
    }
}
