package health_test

import (
	"context"
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/ftcomm/ftcomm/backends/nccl/health"
)

// A one-GPU machine (go-nvml's mock standing in for the driver) whose GPU
// reports Xid 79 (fallen off the bus): Critical closes and the member would
// leave the quorum.
func Example() {
	gpu := &mock.Device{
		GetUUIDFunc:                func() (string, nvml.Return) { return "GPU-0", nvml.SUCCESS },
		GetNameFunc:                func() (string, nvml.Return) { return "H200", nvml.SUCCESS },
		GetSupportedEventTypesFunc: func() (uint64, nvml.Return) { return nvml.EventTypeXidCriticalError, nvml.SUCCESS },
		RegisterEventsFunc:         func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS },
		GetTotalEccErrorsFunc: func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
			return 0, nvml.SUCCESS
		},
		GetNvLinkStateFunc: func(int) (nvml.EnableState, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED },
	}
	events := make(chan nvml.EventData, 1)
	events <- nvml.EventData{Device: gpu, EventType: nvml.EventTypeXidCriticalError, EventData: 79}
	lib := &mock.Interface{
		InitFunc:                   func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:               func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:            func(r nvml.Return) string { return r.String() },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return 1, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(int) (nvml.Device, nvml.Return) { return gpu, nvml.SUCCESS },
		EventSetCreateFunc: func() (nvml.EventSet, nvml.Return) {
			return &mock.EventSet{
				WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
					select {
					case e := <-events:
						return e, nvml.SUCCESS
					case <-time.After(time.Duration(ms) * time.Millisecond):
						return nvml.EventData{}, nvml.ERROR_TIMEOUT
					}
				},
				FreeFunc: func() nvml.Return { return nvml.SUCCESS },
			}, nvml.SUCCESS
		},
	}
	mon, err := health.Start(context.Background(), lib, health.DefaultConfig())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer mon.Close()
	<-mon.Critical()
	ev, _ := mon.FirstCritical()
	fmt.Println(ev.Kind, ev.XID, ev.Critical)
	// Output: xid 79 true
}
