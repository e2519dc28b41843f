// Package memstore is an in-memory comm.Store for tests and for jobs whose
// ranks all live in one process.
//
// A Store is safe for concurrent use. Get waits on a per-key channel that Set
// and Add close, never by polling. Close wakes every waiter with
// comm.ErrClosed. Separate Stores share nothing.
package memstore
