package nccl

import (
	"testing"

	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
)

// newFakeWorld is the simulation (package ncclsim) for one test: a fault
// it collects fails the test at cleanup.
func newFakeWorld(t testing.TB, nDev int) *ncclsim.Simulation {
	w := ncclsim.New(nDev)
	t.Cleanup(func() {
		for _, f := range w.Faults() {
			t.Errorf("simulated NCCL: %s", f)
		}
	})
	return w
}

// simLibrary is a Library on w, as OpenSimulation opens one with the
// default config (eager connection set-up, the default copy streams).
func simLibrary(w *ncclsim.Simulation) *Library { return simulatedLibrary(w, 0, true) }

// libraryWith makes a library on w with n copy streams per device.
func libraryWith(t testing.TB, w *ncclsim.Simulation, copyStreams int) *Library {
	L, err := OpenSimulation(w, LibraryConfig{CopyStreams: copyStreams})
	if err != nil {
		t.Fatal(err)
	}
	return L
}
