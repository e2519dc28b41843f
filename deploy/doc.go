// Package deploy holds what it takes to run ftcomm on a cluster, and the
// test that the walkthrough of docs/deploy.md works:
//
//	Dockerfile, build-image.sh   the ftcoord and trainer images (build-image.sh needs no Docker daemon)
//	mkimage/                     writes those images as OCI layouts, reproducibly, and checks one
//	kubernetes/                  kustomize bases and overlays: etcd, ftcoord (3 replicas or single), a training Job
//	k8sschema/                   Kubernetes' and cert-manager's OpenAPI schemas as kubeconform's JSON schemas
//	validate.sh                  renders every overlay and validates it with kubeconform (CI runs it)
//	etcd/                        the etcd server of the version this module pins, for local runs
//	loopback.sh                  the 3-replica topology as processes on this machine
//
// TestLoopbackDeployment (loopback_test.go) runs that topology with the
// manifests' settings: a 3-member etcd cluster with TLS, client
// certificates and authentication, three ftcoord instances, trainers
// joining with the credentials file, and the leader SIGKILLed.
package deploy
