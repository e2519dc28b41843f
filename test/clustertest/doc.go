// Package clustertest runs, inside one test process, what the tests of
// membership, the coordinator and the etcd host share: an embedded etcd,
// coordinators that lead it, and members of one job; and the same secured
// (TLS, etcd roles, signed quorums) as `ftcoord serve` runs it.
//
// Everything a helper starts is stopped by the test's Cleanup, in reverse
// order: members, then coordinators, then etcd. Helpers call t.Fatal on
// failure, so call them from the test's goroutine. Every wait has a
// deadline; nothing sleeps. Two Jobs in one process share nothing.
package clustertest
