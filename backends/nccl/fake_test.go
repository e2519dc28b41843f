package nccl

import "testing"

// newFakeWorld is the simulation (sim.go) for one test: a fault it
// collects fails the test at cleanup.
func newFakeWorld(t testing.TB, nDev int) *Simulation {
	w := NewSimulation(nDev)
	t.Cleanup(func() {
		for _, f := range w.Faults() {
			t.Errorf("simulated NCCL: %s", f)
		}
	})
	return w
}

// libraryWith makes a library on w with n copy streams per device.
func libraryWith(t testing.TB, w *Simulation, copyStreams int) *Library {
	L, err := w.LibraryWith(LibraryConfig{CopyStreams: copyStreams})
	if err != nil {
		t.Fatal(err)
	}
	return L
}
