// Package etcdhost runs etcd inside a process and secures it for ftcomm:
// what a coordinator's host needs, and no trainer links (it brings etcd's
// server and bbolt).
//
//   - Embedded (StartEmbedded): a single-member etcd server, by default on
//     free loopback ports with a temporary data directory: for tests,
//     tools and the default `ftcoord serve`. On a data directory of its
//     own it listens, after a restart, on the ports of its last start
//     (kept in <Dir>/ftcomm-addresses.json), so clients' endpoints stay
//     valid; a kept client port that another process took fails the start
//     (*KeptAddrInUseError). EmbeddedCluster
//     (StartEmbeddedCluster) runs several members in one process, each of
//     which can be stopped on its own.
//   - EmbeddedConfig.Secure: etcd serves TLS and requires a client
//     certificate of its own CA (made on first start in <dir>/pki, kept
//     across restarts, leaf certificates renewed before they expire), and
//     etcd's authentication with two roles (ConfigureAuth, AuthRanges):
//     coordinators (UserCoordinator) read and write the root; trainers
//     (UserTrainer) read the root and write only under <root>/<job>/ —
//     never quorums, history, keep-out records or the election. The
//     certificate's common name is the etcd user. Without Secure (the
//     default) anyone who reaches the port can rewrite every job.
//   - Embedded.Access mints what a user needs to reach the server
//     (endpoints, root, CA, client certificate and key). ftcoord turns the
//     trainers' into membership.Credentials, adds the coordinators' quorum
//     keys and the gossip key, and stores them with
//     membership.WriteCredentials (0600). This package does not import
//     membership: the member client links no etcd server, and the etcd
//     host knows nothing of members.
//   - For an external etcd, secure it as etcd documents (TLS, client
//     certificates, authentication): WritePKI makes the certificates, and
//     ConfigureAuth, run once as etcd's root, creates ftcomm's roles and
//     users (or grant the ranges of AuthRanges with etcdctl).
//
// # Lifecycle and concurrency
//
// StartEmbedded returns once the server serves clients, or fails when ctx
// ends first. Its data directory is locked while it runs, so a second
// server on it fails at once with ErrDataDirInUse instead of waiting for
// etcd's database lock. Close stops etcd without waiting for clients'
// watches and keepalives (they are ended first, as Unavailable, and
// clients retry), closes the client Client returned, removes a temporary
// data directory, and is safe to call twice. Embedded and
// EmbeddedCluster are safe for concurrent use; the caller closes the
// clients NewClient returns.
package etcdhost
