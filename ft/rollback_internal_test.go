package ft

import "testing"

// A rollback still pending when another happens (its epoch superseded
// before the loop's Step returned) is merged into the new one: the loop
// hears of every discarded step once, from the earliest, now at the newest
// step, and of a snapshot restore among them.
func TestNoteRollbackMerges(t *testing.T) {
	var m machine
	m.noteRollback(&RollbackError{FromStep: 5, ToStep: 6, Step: 7, Epoch: 3})
	m.noteRollback(&RollbackError{FromStep: 7, ToStep: 9, Step: 10, Epoch: 6, Snapshot: true})
	want := RollbackError{FromStep: 5, ToStep: 9, Step: 10, Epoch: 3, Snapshot: true}
	if got := *m.rollback; got != want {
		t.Fatalf("merged rollback %+v, want %+v", got, want)
	}
	m.rollback = nil
	m.noteRollback(&RollbackError{FromStep: 4, ToStep: 4, Step: 8, Epoch: 2})
	if got := *m.rollback; got != (RollbackError{FromStep: 4, ToStep: 4, Step: 8, Epoch: 2}) {
		t.Fatalf("a rollback alone: %+v", got)
	}
}
