//! What workers of one deployment say to each other. A miss asks the
//! peers over the broker (`wire`: queries and offers) before it goes to the
//! image's source; a master crosses from one worker to another on the peer
//! listener, fetched with a URL signed by the secret every worker shares
//! (`token`), as a Swift temp URL is: it names one master and an expiry, so
//! a URL that leaks opens nothing else and not for long. A master still
//! being downloaded is streamed to the workers waiting for it as it is
//! written (`live`), and checked by them once its holder committed it.
//! Every query and offer on the broker is sealed with the same secret
//! (`seal`): only the deployment's own workers can ask or answer.

pub mod live;
pub(crate) mod seal;
pub(crate) mod token;
pub mod wire;
