package coordinator

import "errors"

// Errors callers branch on with errors.Is.
var (
	// ErrNotLeader: a coordinator lost (or never had) leadership while
	// writing; its write was refused by the fence.
	ErrNotLeader = errors.New("coordinator: not the coordinator leader")
	// ErrKeyMismatch: coordinators of one root sign quorums with
	// different keys (or some sign and some do not).
	ErrKeyMismatch = errors.New("coordinator: coordinators sign quorums with different keys")
	// ErrNoQuorum: no quorum has been published for the job yet.
	ErrNoQuorum = errors.New("coordinator: no quorum published")
	// ErrNotFound: no such job or member.
	ErrNotFound = errors.New("coordinator: not found")
)
