#!/bin/sh
# Host discovery for the elastic test: the hosts file lists "localhost:<slots>".
cat "$HVA_ELASTIC_HOSTS_FILE"
