//go:build !cgo

package nccl

import (
	"fmt"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// dlLibrary does not exist without cgo; openLibrary says so.
type dlLibrary struct {
	libapi.Library
	ncclPath, cudartPath string
}

func openLibrary(ncclPath, cudartPath string) (*dlLibrary, error) {
	return nil, fmt.Errorf("nccl: %w: built without cgo (CGO_ENABLED=0), so libnccl cannot be loaded", comm.ErrBackendUnavailable)
}

func probeDriverCUDA(string) int { return 0 }
