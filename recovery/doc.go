// Package recovery moves a replica's committed state to a replica that is
// behind ("live healing"): no checkpoint on disk, no job restart.
//
// Every replica runs a Server. While its state is the committed state of a
// step — from the end of ft.Comm.Step until Commit, when the training loop
// reads but does not write it — the replica Offers the state's memory; at
// Commit it Withdraws (waiting for reads in flight) before the optimizer
// changes it. Nothing is copied, and state of a step that never committed is
// never served.
//
// A healer calls Fetch with the step it needs and the addresses of every
// up-to-date peer. Fetch waits until each source offers that step, checks
// that they all serve the healer's layout (names and sizes), then pulls
// fixed-size chunks from all sources in parallel out of one queue, so a
// faster source serves more; each chunk is checked against the CRC-32C the
// source sent with it; a failed or corrupt chunk is fetched again
// (cenkalti/backoff), from another source if its own keeps failing; a source
// that fails MaxFailures chunks in a row is dropped, and the fetch fails only
// when every source has.
//
// The wire protocol is two GETs over HTTP (/v1/manifest, /v1/chunk), each
// signed with an HMAC-SHA256 over the job, the request and a timestamp keyed
// by the job's secret; unsigned, wrongly signed or stale requests get 401 and
// nothing else.
//
// Concurrency: a Server is safe for concurrent use; its goroutines (net/http's
// accept loop and connection handlers) exit in Close. Fetch runs
// Streams goroutines per source and returns after all have exited.
package recovery
