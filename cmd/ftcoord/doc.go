// Command ftcoord is the ftcomm coordinator service: it forms and publishes
// the quorums of every job (package coordinator), and serves a JSON API, a
// live dashboard, Prometheus metrics and a health check.
//
//	ftcoord serve                          # embedded single-node etcd in ./ftcoord-data, secured
//	ftcoord serve -etcd h1:2379,h2:2379    # an external etcd cluster; run several for failover
//	ftcoord status -addr http://host:8080 [-job J]
//	ftcoord job new-run [-run ID] J        # a new run of job J: its trainers start from step 0
//	ftcoord credentials                    # print the trainers' credentials file serve wrote
//	ftcoord version                        # or --version: version, revision, Go, platform
//	ftcoord certs | secrets | etcd-init    # set up an external etcd: CA and certificates, shared keys, users/roles/auth
//
// docs/deploy.md runs it on Kubernetes (deploy/: images, manifests) and
// lists its ports: 8080 HTTP (-listen), 7946 TCP+UDP gossip
// (-gossip-addr), 2379 the embedded etcd's clients (-etcd-client-addr).
// Each listener has an advertised address for pods and NAT: -advertise,
// -gossip-advertise, -etcd-advertise-addr, all defaulting to
// -advertise-host (a pod's IP) with the listen port. -name defaults to
// the host name (a StatefulSet's pod name: stable across restarts).
// -log-format json writes one JSON object a line.
//
// Several instances on one etcd elect one leader; the others answer the
// API from etcd and take over when the leader dies (after -session-ttl,
// default 3 s: measured 2.9–3.0 s from SIGKILL to the next epoch with it,
// 1.8–2.1 s with -session-ttl 2s). SIGTERM or SIGINT shuts an instance
// down within -shutdown-timeout (default 10 s; in practice tens of
// milliseconds, members and watches attached or not): it resigns
// leadership (a standby takes over at once), finishes HTTP requests and
// stops its embedded etcd, ending clients' streams first. Restarted on the
// same data directory, the embedded etcd listens where it did (the ports
// of the first start are kept in <data-dir>/ftcomm-addresses.json; the
// trainers' credentials name them); if another process took its client
// port meanwhile, ftcoord says so and exits with status 1 rather than
// move. A restart faster than the members' lease TTL costs no epoch:
// leases live in etcd's data, and members reconnect within 0.5 s. When
// the endpoints do change (-etcd-client-addr, -etcd-advertise-addr), a
// trainer whose endpoints all fail reads its credentials file again and
// moves to the ones it names.
// At start an instance waits up to 30 s for an external etcd that does not
// answer yet (logging each retry); wrong credentials fail it at once.
//
// # Security (secure by default)
//
// On first start `ftcoord serve` makes, in its data directory:
//
//	pki/ca.pem, ca-key.pem                 the embedded etcd's CA
//	pki/server.pem, server-key.pem         etcd's certificate (loopback, the listen and advertised
//	                                       hosts, -etcd-cert-hosts; renewed when they change)
//	pki/{root,ftcoord,trainer}.pem, -key.pem   client certificates; the common name is the etcd user
//	coordinator-secrets.json               the quorum-signing key and the gossip key (0600)
//	trainer-credentials.json               what trainers need, in one file (0600, rewritten at each start)
//
// The embedded etcd serves TLS only to clients with a certificate of its
// CA, with etcd's authentication on: the coordinator's user may write the
// whole root, the trainers' only their jobs' keys (member records,
// revocations, rendezvous, commit records), never quorums, history, the
// election or keep-out records. Quorums are signed; members act on no
// other (a forged one is logged and ignored) and the leader restores its
// own record at once. Gossip is encrypted with the generated key
// (-gossip-key overrides), so a node without it cannot join the cell.
//
// Give trainers the credentials file: FTCOMM_CREDENTIALS=<data-dir>/
// trainer-credentials.json in their environment, or ft.Config.Credentials.
// It names the etcd endpoints (-etcd-advertise-addr when trainers reach
// the host by another name; the certificate covers it, and
// -etcd-cert-hosts adds more names). The log
// line "trainer credentials written" gives its path. For etcdctl, use the
// files in pki/: etcdctl --endpoints <host:port> --cacert pki/ca.pem
// --cert pki/root.pem --key pki/root-key.pem … (root: everything;
// trainer: what a member may do).
//
// With -etcd (an external cluster) the operator secures etcd: -etcd-cacert,
// -etcd-cert/-etcd-key or -etcd-user/-etcd-password reach it;
// etcdhost.ConfigureAuth (run once as etcd's root) creates ftcomm's roles,
// or see etcdhost.AuthRanges for the key ranges to grant with etcdctl.
// The trainers' identity (-trainer-etcd-cert/-key, -trainer-etcd-user/
// -password) goes into the credentials file written to -data-dir with the
// CA, the endpoints, the quorum key and the gossip key. Instances of one
// root must share coordinator-secrets.json (-secrets-file): an instance
// whose key differs from a running one's exits with an error.
//
// -insecure turns all of it off (plain TCP, no authentication, unsigned
// quorums, gossip unencrypted unless -gossip-key): anyone who reaches
// etcd's port can rewrite every job. It is logged as a warning at start;
// use it for local experiments only. A data directory made secure cannot
// be opened with -insecure (nobody could authenticate).
//
// One data directory serves one process: a second `ftcoord serve` on it
// exits at once with status 1, naming the process that holds it.
//
// # HTTP
//
// JSON unless noted; with -token, everything but / and /healthz wants
// "Authorization: Bearer <token>":
//
//	GET  /                                       dashboard (HTML)
//	GET  /healthz                                200 when etcd answers
//	GET  /metrics                                Prometheus
//	GET  /api/v1/coordinator                     this instance and the leader
//	GET  /api/v1/jobs                            jobs with epoch and counts
//	GET  /api/v1/jobs/{job}                      quorum, members, revocations, why waiting
//	GET  /api/v1/jobs/{job}/members              members
//	GET  /api/v1/jobs/{job}/quorum               current quorum (404 when none)
//	GET  /api/v1/jobs/{job}/history?limit=N      past quorums, newest first
//	POST /api/v1/jobs/{job}/members/{id}/evict   body optional: {"by": …, "reason": …, "keepOut": "10m"}
//	POST /api/v1/jobs/{job}/runs                 a new run; body optional: {"run": id, "by": …}
//
// An evicted member may not register again for -evict-keep-out (default
// 1m; a request's "keepOut" overrides, "0s": not kept out); the answer
// gives "keptOutUntil", and the member's Join fails with
// membership.KeptOutError saying until when. A new run (`ftcoord job
// new-run`) becomes the job's current run and clears its commit records,
// so that trainers with an empty ft.Config.Run begin it from step 0; it is
// refused while the job has live members, or for an id the job used
// before. `ftcoord status -job` names the run and the members that wait
// for a holder of a committed step (ft's DurableCommit), with why. Lease
// ids are JSON strings (they exceed 2^53). Errors are {"error": "…"} with
// 400 (bad input), 401 (token), 404 (no such job, member or endpoint),
// 405 with an Allow header (a known path, another method), 409 (a new run
// refused), 413 (a body over 64 KiB) or 503 (etcd unavailable). Each connection is cut after 5 s without its headers, 30 s
// without its body or without reading the answer, 60 s idle.
//
// Metrics name a job with the label ftcomm_job (not "job", which
// Prometheus sets to the scrape job and would rename to exported_job):
// ftcomm_coordinator_{epoch,members,participants,waiting_members}{ftcomm_job},
// ftcomm_coordinator_{quorums,joins,foreign_quorum_writes,publish_too_large}_total{ftcomm_job},
// ftcomm_coordinator_removals_total{ftcomm_job,cause},
// ftcomm_coordinator_{leader,jobs,gossip_alive},
// ftcomm_coordinator_publish_seconds, and
// ftcomm_coordinator_build_info{version,revision,goversion} (1).
//
// The service itself is package server (coordinator/server), so that
// another program can run an embedded ftcoord with its dashboard in
// process; this command adds flags, signals and the status CLI.
//
// Every flag can be set by an environment variable FTCOORD_<FLAG>; invalid
// configuration makes ftcoord say what is wrong and exit with status 2.
package main
