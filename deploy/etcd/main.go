// Command etcd is the etcd server of the version this module pins
// (go.etcd.io/etcd/server/v3, the one ftcoord embeds), with etcd's own
// flags: for the loopback walkthrough of docs/deploy.md and its test
// (deploy/loopback_test.go), where no etcd is installed. In a cluster,
// run etcd's official image of the same version (deploy/kubernetes/etcd).
//
//	go build -o bin/etcd ./deploy/etcd && bin/etcd --version
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
